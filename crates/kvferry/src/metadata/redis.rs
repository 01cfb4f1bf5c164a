//! Redis backend: `GET`/`SET`/`DEL` of Mooncake's keys (its hiredis plugin does the same),
//! over the `redis` crate's synchronous connection (RESP2, no async runtime). One connection,
//! re-opened once on failure; connecting (including `AUTH` and `SELECT`) and every command are
//! bounded by the configured timeouts. Credentials and database come from the URL
//! (`redis://[user:pass@]host:port[/db]`, parsed by [`super::ConnString`] as Mooncake does) or
//! `MC_REDIS_USERNAME`/`MC_REDIS_PASSWORD`/`MC_REDIS_DB_INDEX`.

use super::{Backend, MetadataStore, Seen, StoreOptions};
use crate::error::{Error, Result};
use redis::io::tcp::TcpSettings;
use redis::{
    ConnectionAddr, ConnectionLike, ErrorKind, IntoConnectionInfo, RedisConnectionInfo, RedisError,
    Value,
};
use std::sync::Mutex;
use std::time::Duration;

/// Largest value accepted (a descriptor of ~100k buffers).
const MAX_VALUE: usize = 128 << 20;

pub(crate) struct RedisStore {
    location: String,
    client: redis::Client,
    /// A password was sent: an authentication failure names where it came from.
    has_password: bool,
    timeout: Duration,
    connect_timeout: Duration,
    conn: Mutex<Option<redis::Connection>>,
}

/// What a failed command means for the connection it ran on.
enum Failure {
    /// The server answered an error: the connection is fine.
    Server(RedisError),
    /// Broken connection (or protocol error): open another one and try once more.
    Broken(RedisError),
    /// Timed out: give up (another try would double the caller's wait).
    TimedOut(RedisError),
}

impl RedisStore {
    pub(crate) fn new(
        host: &str,
        port: u16,
        username: Option<String>,
        password: Option<String>,
        db: Option<u32>,
        opts: &StoreOptions,
    ) -> Result<RedisStore> {
        let location = match db {
            Some(d) => format!("redis://{host}:{port}/{d}"),
            None => format!("redis://{host}:{port}"),
        };
        let config_err = |e: RedisError| Error::Metadata {
            backend: Backend::Redis.name(),
            location: location.clone(),
            reason: format!("invalid connection settings: {e}"),
        };
        // hiredis sends nothing but the commands (no CLIENT SETINFO, which Redis < 7.2 lacks).
        let mut redis = RedisConnectionInfo::default()
            .set_skip_set_lib_name()
            .set_db(i64::from(db.unwrap_or(0)));
        if let Some(p) = &password {
            redis = redis.set_password(p);
            if let Some(u) = &username {
                redis = redis.set_username(u);
            }
        }
        let info = ConnectionAddr::Tcp(host.to_string(), port)
            .into_connection_info()
            .map_err(config_err)?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true))
            .set_redis_settings(redis);
        let client = redis::Client::open(info).map_err(config_err)?;
        Ok(RedisStore {
            location,
            client,
            has_password: password.is_some(),
            timeout: opts.timeout,
            connect_timeout: opts.connect_timeout(),
            conn: Mutex::new(None),
        })
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata {
            backend: Backend::Redis.name(),
            location: self.location.clone(),
            reason,
        }
    }

    /// Connects, authenticates and selects the database, all within the connect timeout; then
    /// bounds every later read and write by the request timeout.
    fn open(&self) -> std::result::Result<redis::Connection, RedisError> {
        let c = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    /// An authentication problem (wrong or missing password, user not allowed).
    fn auth_problem(e: &RedisError) -> bool {
        e.kind() == ErrorKind::AuthenticationFailed
            || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    }

    fn auth_hint(&self) -> &'static str {
        if self.has_password {
            " (AUTH refused: check the user and password in the URL, redis://user:password@host:port, or MC_REDIS_USERNAME / MC_REDIS_PASSWORD)"
        } else {
            " (the server requires a password: put it in the URL, redis://:password@host:port, or set MC_REDIS_PASSWORD)"
        }
    }

    fn connect_failure(&self, what: &str, e: &RedisError) -> Error {
        let hint = if Self::auth_problem(e) {
            self.auth_hint()
        } else if e.is_timeout() {
            " (timed out: is redis-server up and reachable from here?)"
        } else if e.is_io_error() {
            " (is redis-server running at this address?)"
        } else {
            ""
        };
        self.err(format!("{what}: cannot connect: {e}{hint}"))
    }

    fn run(c: &mut redis::Connection, cmd: &redis::Cmd) -> std::result::Result<Value, Failure> {
        match cmd.query::<Value>(c) {
            Ok(Value::ServerError(e)) => Err(Failure::Server(e.into())),
            Ok(v) => Ok(v),
            Err(e) if e.is_timeout() => Err(Failure::TimedOut(e)),
            Err(e)
                if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
                    && c.is_open() =>
            {
                Err(Failure::Server(e))
            }
            Err(e) => Err(Failure::Broken(e)),
        }
    }

    /// Runs one command; on a broken connection opens a new one and tries once more.
    fn call(&self, what: &str, cmd: &redis::Cmd) -> Result<Value> {
        let mut slot = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let mut last = None;
        for _ in 0..2 {
            let c = match slot.as_mut() {
                Some(c) => c,
                None => match self.open() {
                    Ok(c) => slot.insert(c),
                    Err(e) => return Err(self.connect_failure(what, &e)),
                },
            };
            match Self::run(c, cmd) {
                Ok(v) => return Ok(v),
                Err(Failure::Server(e)) => {
                    let hint = if Self::auth_problem(&e) {
                        self.auth_hint()
                    } else {
                        ""
                    };
                    return Err(
                        self.err(format!("{what}: the server answered an error: {e}{hint}"))
                    );
                }
                Err(Failure::TimedOut(e)) => {
                    *slot = None;
                    return Err(self.err(format!("{what}: timed out after {:?}: {e} (is redis-server overloaded or unreachable?)", self.timeout)));
                }
                Err(Failure::Broken(e)) => {
                    *slot = None;
                    last = Some(e);
                }
            }
        }
        let hint = match &last {
            Some(e) if e.kind() == ErrorKind::Parse => {
                " (the answer is not Redis protocol: is this address a Redis server?)"
            }
            _ => " (the connection broke twice: is redis-server healthy?)",
        };
        Err(self.err(format!(
            "{what}: {}{hint}",
            last.map(|e| e.to_string()).unwrap_or_default()
        )))
    }
}

impl MetadataStore for RedisStore {
    fn backend(&self) -> Backend {
        Backend::Redis
    }

    fn location(&self) -> &str {
        &self.location
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let what = format!("GET {key}");
        match self.call(&what, redis::cmd("GET").arg(key))? {
            Value::Nil => Ok(None),
            Value::BulkString(v) if v.len() > MAX_VALUE => Err(self.err(format!(
                "{what}: the value of {} bytes is larger than {MAX_VALUE}",
                v.len()
            ))),
            Value::BulkString(v) => Ok(Some(v)),
            other => Err(self.err(format!(
                "{what}: unexpected reply {other:?} (is {key} a string key?)"
            ))),
        }
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(&format!("SET {key}"), redis::cmd("SET").arg(key).arg(value))
            .map(|_| ())
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.call(&format!("DEL {key}"), redis::cmd("DEL").arg(key))
            .map(|_| ())
    }

    /// A script (Redis runs one at a time): `DEL` only if `GET` gives the value seen (Redis
    /// keeps no revision: an identical value written since is not told apart).
    fn remove_if(&self, key: &str, seen: &Seen) -> Result<bool> {
        const SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
        match self.call(
            &format!("DEL {key} (if unchanged)"),
            redis::cmd("EVAL")
                .arg(SCRIPT)
                .arg(1)
                .arg(key)
                .arg(&seen.value[..]),
        )? {
            Value::Int(n) => Ok(n > 0),
            other => Err(self.err(format!(
                "DEL {key} (if unchanged): unexpected reply {other:?}"
            ))),
        }
    }

    /// `SET key value NX` (one command: nothing between the look and the write).
    fn create(&self, key: &str, value: &[u8]) -> Result<bool> {
        match self.call(
            &format!("SET {key} NX"),
            redis::cmd("SET").arg(key).arg(value).arg("NX"),
        )? {
            Value::Nil => Ok(self.get(key)?.is_some_and(|v| v == value)),
            _ => Ok(true),
        }
    }
}
