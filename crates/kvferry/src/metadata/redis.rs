//! Redis backend: `GET`/`SET`/`DEL` of Mooncake's keys (its hiredis plugin does the same),
//! over a small blocking RESP2 client. One connection, re-opened once on failure; every call
//! is bounded by the configured timeout. `AUTH` and `SELECT` come from the URL
//! (`redis://[user:pass@]host:port[/db]`) or `MC_REDIS_USERNAME`/`MC_REDIS_PASSWORD`/
//! `MC_REDIS_DB_INDEX`.

use super::{Backend, MetadataStore, StoreOptions};
use crate::error::{Error, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

/// Largest bulk string accepted (a descriptor of ~100k buffers).
const MAX_BULK: usize = 128 << 20;

/// A RESP2 reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// Encodes a command as a RESP array of bulk strings.
pub fn encode_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn bad_data(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

/// Reads one reply; malformed input is an error, never a panic.
pub fn read_reply(r: &mut impl BufRead, depth: u32) -> std::io::Result<Reply> {
    if depth > 8 {
        return Err(bad_data("reply nested too deeply"));
    }
    let mut line = Vec::new();
    r.by_ref().take(64 * 1024).read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed by the server"));
    }
    if !line.ends_with(b"\r\n") || line.len() < 3 {
        return Err(bad_data("malformed reply line"));
    }
    let body = String::from_utf8_lossy(&line[1..line.len() - 2]).into_owned();
    let int = |s: &str| s.parse::<i64>().map_err(|_| bad_data(format!("bad integer {s:?} in reply")));
    match line[0] {
        b'+' => Ok(Reply::Simple(body)),
        b'-' => Ok(Reply::Error(body)),
        b':' => Ok(Reply::Int(int(&body)?)),
        b'$' => {
            let n = int(&body)?;
            if n < 0 {
                return Ok(Reply::Bulk(None));
            }
            let n = n as usize;
            if n > MAX_BULK {
                return Err(bad_data(format!("value of {n} bytes is larger than {MAX_BULK}")));
            }
            let mut buf = Vec::new();
            r.by_ref().take(n as u64 + 2).read_to_end(&mut buf)?;
            if buf.len() != n + 2 || &buf[n..] != b"\r\n" {
                return Err(bad_data("truncated bulk string"));
            }
            buf.truncate(n);
            Ok(Reply::Bulk(Some(buf)))
        }
        b'*' => {
            let n = int(&body)?;
            if n < 0 {
                return Ok(Reply::Array(None));
            }
            if n > 1024 {
                return Err(bad_data("array reply too long"));
            }
            (0..n).map(|_| read_reply(r, depth + 1)).collect::<std::io::Result<Vec<_>>>().map(|v| Reply::Array(Some(v)))
        }
        c => Err(bad_data(format!("unexpected reply type byte 0x{c:02x} (is this a Redis server?)"))),
    }
}

struct Conn {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

pub struct RedisStore {
    location: String,
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: Option<u32>,
    timeout: Duration,
    connect_timeout: Duration,
    conn: Mutex<Option<Conn>>,
}

impl RedisStore {
    pub fn new(host: &str, port: u16, username: Option<String>, password: Option<String>, db: Option<u32>, opts: &StoreOptions) -> Result<RedisStore> {
        let location = match db {
            Some(d) => format!("redis://{host}:{port}/{d}"),
            None => format!("redis://{host}:{port}"),
        };
        Ok(RedisStore {
            location,
            host: host.to_string(),
            port,
            username,
            password,
            db,
            timeout: opts.timeout,
            connect_timeout: opts.connect_timeout(),
            conn: Mutex::new(None),
        })
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata { backend: Backend::Redis.name(), location: self.location.clone(), reason }
    }

    fn open(&self) -> std::io::Result<Conn> {
        let mut last = None;
        for a in (self.host.as_str(), self.port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, self.connect_timeout) {
                Ok(s) => {
                    s.set_read_timeout(Some(self.timeout))?;
                    s.set_write_timeout(Some(self.timeout))?;
                    let _ = s.set_nodelay(true);
                    let mut c = Conn { r: BufReader::new(s.try_clone()?), w: s };
                    if let Some(p) = &self.password {
                        let mut args: Vec<&[u8]> = vec![b"AUTH"];
                        if let Some(u) = &self.username {
                            args.push(u.as_bytes());
                        }
                        args.push(p.as_bytes());
                        if let Reply::Error(e) = Self::roundtrip(&mut c, &args)? {
                            return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("AUTH refused: {e} (check the password in the URL or MC_REDIS_PASSWORD)")));
                        }
                    }
                    if let Some(db) = self.db {
                        let d = db.to_string();
                        if let Reply::Error(e) = Self::roundtrip(&mut c, &[b"SELECT", d.as_bytes()])? {
                            return Err(bad_data(format!("SELECT {db} refused: {e}")));
                        }
                    }
                    return Ok(c);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} resolves to no address", self.host))))
    }

    fn roundtrip(c: &mut Conn, args: &[&[u8]]) -> std::io::Result<Reply> {
        c.w.write_all(&encode_command(args))?;
        read_reply(&mut c.r, 0)
    }

    /// Runs one command; on a broken connection opens a new one and tries once more.
    fn call(&self, what: &str, args: &[&[u8]]) -> Result<Reply> {
        let mut slot = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let mut last = None;
        for _ in 0..2 {
            if slot.is_none() {
                match self.open() {
                    Ok(c) => *slot = Some(c),
                    Err(e) => {
                        let hint = if e.kind() == std::io::ErrorKind::PermissionDenied { "" } else { " (is redis-server running at this address?)" };
                        return Err(self.err(format!("{what}: cannot connect: {e}{hint}")));
                    }
                }
            }
            let Some(c) = slot.as_mut() else { continue };
            match Self::roundtrip(c, args) {
                Ok(Reply::Error(e)) => return Err(self.err(format!("{what}: the server answered an error: {e}"))),
                Ok(r) => return Ok(r),
                Err(e) => {
                    *slot = None;
                    let timed_out = matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut);
                    last = Some(e);
                    if timed_out {
                        break;
                    }
                }
            }
        }
        Err(self.err(format!("{what}: {}", last.map(|e| e.to_string()).unwrap_or_default())))
    }

    /// `PING`, for `kvferry doctor`.
    pub fn ping(&self) -> Result<()> {
        self.call("PING", &[b"PING"]).map(|_| ())
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
        match self.call(&format!("GET {key}"), &[b"GET", key.as_bytes()])? {
            Reply::Bulk(v) => Ok(v),
            other => Err(self.err(format!("GET {key}: unexpected reply {other:?}"))),
        }
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(&format!("SET {key}"), &[b"SET", key.as_bytes(), value]).map(|_| ())
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.call(&format!("DEL {key}"), &[b"DEL", key.as_bytes()]).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn resp() {
        assert_eq!(encode_command(&[b"GET", b"k"]), b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
        let mut r = &b"$3\r\nabc\r\n$-1\r\n+OK\r\n:5\r\n-ERR x\r\n*2\r\n:1\r\n$0\r\n\r\n"[..];
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Bulk(Some(b"abc".to_vec())));
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Bulk(None));
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Simple("OK".into()));
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Int(5));
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Error("ERR x".into()));
        assert_eq!(read_reply(&mut r, 0).unwrap(), Reply::Array(Some(vec![Reply::Int(1), Reply::Bulk(Some(vec![]))])));
        assert!(read_reply(&mut &b"$5\r\nab\r\n"[..], 0).is_err());
        assert!(read_reply(&mut &b"HTTP/1.1 400\r\n"[..], 0).is_err());
        assert!(read_reply(&mut &b"$99999999999\r\n"[..], 0).is_err());
    }

    proptest! {
        #[test]
        fn reply_parser_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = read_reply(&mut &b[..], 0);
        }
    }
}
