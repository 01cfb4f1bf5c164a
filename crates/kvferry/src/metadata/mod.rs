//! The metadata service: a shared directory where engines publish their segments so that any
//! node finds any segment by name (Mooncake's "central" mode, reference §2).
//!
//! - [`MetadataStore`] is one backend: `http::HttpStore` (Mooncake's HTTP contract, e.g.
//!   `kvferry metadata-server` or `mooncake_http_metadata_server`), `etcd::EtcdStore` (etcd v3,
//!   entries under a lease so a crashed engine disappears by itself) and `redis::RedisStore`.
//!   Every build has all three.
//! - [`ConnString`] parses the connection string exactly as Mooncake does: `P2PHANDSHAKE`,
//!   `http://host:port/metadata` (or `https://`, verified against the built-in public roots or
//!   `KVFERRY_METADATA_CA_FILE`), `etcd://h1:2379,h2:2379` (a bare `host:port` means etcd),
//!   `redis://[user:pass@]host:port[/db]`.
//! - [`Keys`] is Mooncake's key layout: `mooncake/[<cluster id>/]rpc_meta/<name>` =
//!   [`RpcMeta`], `mooncake/[<cluster id>/]ram/<name>` = the segment descriptor JSON.
//! - [`Directory`] is what an engine holds: it publishes the engine's entries, remembers them,
//!   and a keeper thread keeps them alive (etcd lease keepalive) and re-publishes whatever the
//!   service lost (an etcd, Redis or HTTP server restarted without its data).
//!
//! Everything here is synchronous from the caller's side: blocking sockets (HTTP, Redis) or a
//! HTTP request to etcd's JSON gateway in the etcd backend (no async runtime).

pub mod etcd;
pub(crate) mod http;
pub(crate) mod redis;

use crate::error::{Error, Result};
use crate::wire::descriptor::SegmentDesc;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The backends, as named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Http,
    Etcd,
    Redis,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Http => "http",
            Backend::Etcd => "etcd",
            Backend::Redis => "redis",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the connection strings may look like; listed in the error for an unknown one.
pub(crate) const SUPPORTED: &str = "P2PHANDSHAKE, http://host:port/metadata (or https://), etcd://host:2379[,host2:2379...] (or a bare host:port, which means etcd), redis://[user:password@]host:port[/db]";

/// A parsed metadata connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnString {
    /// No service: peers exchange descriptors over the handshake port.
    P2p,
    /// `http(s)://host:port/path`: the full URL the keys are appended to as `?key=`.
    Http { url: String },
    /// etcd endpoints, each `host:port`.
    Etcd { endpoints: Vec<String> },
    /// `redis://[user:pass@]host:port[/db]`.
    Redis {
        host: String,
        port: u16,
        username: Option<String>,
        password: Option<String>,
        db: Option<u32>,
    },
}

fn bad(s: &str, why: impl std::fmt::Display) -> Error {
    Error::Config(format!(
        "metadata server {s:?}: {why}; supported forms: {SUPPORTED}"
    ))
}

fn check_host_port(whole: &str, hp: &str, default_port: Option<u16>) -> Result<(String, u16)> {
    let (h, p) = crate::config::split_host_port(hp);
    if h.is_empty() || h.contains('/') || h.contains('@') {
        return Err(bad(whole, format!("{hp:?} is not host:port")));
    }
    match (p, default_port) {
        (Some(p), _) | (None, Some(p)) if p != 0 => Ok((h.to_string(), p)),
        _ => Err(bad(whole, format!("{hp:?} has no port (or port 0)"))),
    }
}

impl ConnString {
    /// Parses a connection string the way Mooncake does; an unknown scheme lists the
    /// supported ones.
    pub fn parse(s: &str) -> Result<ConnString> {
        let t = s.trim();
        if t.is_empty() {
            return Err(bad(s, "empty"));
        }
        if t == "P2PHANDSHAKE" {
            return Ok(ConnString::P2p);
        }
        let Some((scheme, rest)) = t.split_once("://") else {
            // No scheme: Mooncake treats `host:port[,host:port]` as etcd.
            return Self::etcd(s, t);
        };
        match scheme.to_ascii_lowercase().as_str() {
            scheme @ ("http" | "https") => {
                let (authority, _) = rest.split_once(['/', '?']).unwrap_or((rest, ""));
                check_host_port(s, authority, Some(if scheme == "https" { 443 } else { 80 }))?;
                Ok(ConnString::Http { url: t.to_string() })
            }
            "etcd" => Self::etcd(s, rest),
            "redis" => {
                let rest = rest.trim_end_matches('/');
                let (auth, hostpart) = match rest.rsplit_once('@') {
                    Some((a, h)) => (Some(a), h),
                    None => (None, rest),
                };
                let (hp, db) = match hostpart.split_once('/') {
                    Some((hp, db)) => {
                        let n: u32 = db
                            .parse()
                            .map_err(|_| bad(s, format!("database {db:?} is not a number")))?;
                        if n > 255 {
                            return Err(bad(s, format!("database {n} is out of range 0-255")));
                        }
                        (hp, Some(n))
                    }
                    None => (hostpart, None),
                };
                let (host, port) = check_host_port(s, hp, Some(6379))?;
                let (username, password) = match auth {
                    None => (None, None),
                    Some(a) => match a.split_once(':') {
                        Some((u, p)) => {
                            ((!u.is_empty()).then(|| u.to_string()), Some(p.to_string()))
                        }
                        None => (None, Some(a.to_string())),
                    },
                };
                Ok(ConnString::Redis {
                    host,
                    port,
                    username,
                    password,
                    db,
                })
            }
            other => Err(bad(s, format!("unknown scheme {other:?}"))),
        }
    }

    fn etcd(whole: &str, list: &str) -> Result<ConnString> {
        let mut endpoints = Vec::new();
        for ep in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let ep = ep
                .strip_prefix("http://")
                .unwrap_or(ep)
                .trim_end_matches('/');
            let (h, p) = check_host_port(whole, ep, None)?;
            endpoints.push(if h.contains(':') {
                format!("[{h}]:{p}")
            } else {
                format!("{h}:{p}")
            });
        }
        if endpoints.is_empty() {
            return Err(bad(whole, "no etcd endpoint"));
        }
        Ok(ConnString::Etcd { endpoints })
    }

    #[cfg(test)]
    pub(crate) fn backend(&self) -> Option<Backend> {
        match self {
            ConnString::P2p => None,
            ConnString::Http { .. } => Some(Backend::Http),
            ConnString::Etcd { .. } => Some(Backend::Etcd),
            ConnString::Redis { .. } => Some(Backend::Redis),
        }
    }
}

/// Connection settings beyond the string.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Bound of every request (connect is bounded by half of it, at most 1.5 s).
    pub timeout: Duration,
    /// TTL of the etcd lease the entries live under.
    pub lease_ttl: Duration,
    /// Redis credentials and database from the environment (`MC_REDIS_*`); the URL wins.
    pub redis_username: Option<String>,
    pub redis_password: Option<String>,
    pub redis_db: Option<u32>,
    /// `https://`: PEM file of the CA certificates to trust instead of the built-in public
    /// roots (`KVFERRY_METADATA_CA_FILE`).
    pub ca_file: Option<std::path::PathBuf>,
    /// The cluster key file (`KVFERRY_AUTH_KEY_FILE`): an `http(s)://` store signs every
    /// request with it ([`crate::auth_http`]), which a keyed `kvferry metadata-server` needs
    /// for its writes; read when the store is opened ([`connect`]), an unusable file an error
    /// there. Other backends do not use it.
    pub auth_key_file: Option<std::path::PathBuf>,
    /// The shared token of HTTP metadata servers (`MC_METADATA_HTTP_TOKEN`, Mooncake 0.3.14):
    /// an `http(s)://` store sends `Authorization: Bearer <token>` with every request. Other
    /// backends do not use it.
    pub http_token: Option<String>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout: Duration::from_secs(3),
            lease_ttl: Duration::from_secs(10),
            redis_username: None,
            redis_password: None,
            redis_db: None,
            ca_file: None,
            auth_key_file: None,
            http_token: None,
        }
    }
}

impl StoreOptions {
    pub fn from_config(c: &crate::Config) -> StoreOptions {
        StoreOptions {
            timeout: c.metadata_timeout,
            lease_ttl: c.metadata_lease_ttl,
            redis_username: c.redis_username.clone(),
            redis_password: c.redis_password.clone(),
            redis_db: c.redis_db,
            ca_file: c.metadata_ca_file.clone(),
            auth_key_file: c.auth_key_file.clone(),
            http_token: c.metadata_http_token.clone(),
        }
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        (self.timeout / 2)
            .min(Duration::from_millis(1500))
            .max(Duration::from_millis(10))
    }
}

/// A value as [`MetadataStore::get_seen`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub value: Vec<u8>,
    /// The write that left it (etcd's `mod_revision`, `kvferry metadata-server`'s `ETag`: a
    /// rewrite of the same value has another); `None` where the backend has no such number.
    pub revision: Option<i64>,
}

/// One metadata backend: a key-value store with Mooncake's keys and values.
///
/// Every call is bounded in time ([`StoreOptions::timeout`]); errors name the backend and
/// its address.
pub trait MetadataStore: Send + Sync {
    fn backend(&self) -> Backend;
    /// The address shown in messages (URL or endpoint list).
    fn location(&self) -> &str;
    /// The value of `key`, `None` when absent.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Sets `key` (etcd: under this store's lease).
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Removes `key`; absent is not an error.
    fn remove(&self, key: &str) -> Result<()>;
    /// Sets `key` (as [`MetadataStore::put`]) only if it is absent or already holds `value`:
    /// `Ok(true)` when it holds `value` now, `Ok(false)` when another value was there (left
    /// as it was). What two engines starting under one name at once rely on to not both
    /// take it. The default (get, then put) is not atomic; every backend of kvferry's
    /// overrides it with one that is.
    fn create(&self, key: &str, value: &[u8]) -> Result<bool> {
        create_by_look(self, key, value)
    }
    /// As [`MetadataStore::get`], with what tells this write of the value from a later
    /// write of the same value ([`Seen::revision`]: etcd's `mod_revision`; elsewhere none).
    fn get_seen(&self, key: &str) -> Result<Option<Seen>> {
        Ok(self.get(key)?.map(|value| Seen {
            value,
            revision: None,
        }))
    }
    /// Removes `key` only if it still holds what `seen` saw: whether it did. What replacing
    /// a dead engine's entry relies on, so that of engines replacing it at once none removes
    /// the entry another one just made. With a revision (etcd) the write itself is compared,
    /// so an identical entry written since (the dead engine restarted at its address) stays;
    /// without one (Redis) the value is, which tells writes apart for the entries kvferry
    /// writes under a dead engine's name: its `rpc_meta` values carry a random number per
    /// write (`encode_rpc_meta`). The default (get, compare, remove) is not atomic;
    /// etcd, Redis and HTTP override it with one that is (HTTP: against `kvferry
    /// metadata-server`, whose `ETag` and `If-Match` compare the write); Mooncake's HTTP
    /// contract has no such operation, so against its servers two engines replacing one dead
    /// entry at the same instant can still both take the name.
    fn remove_if(&self, key: &str, seen: &Seen) -> Result<bool> {
        remove_by_look(self, key, seen)
    }
    /// Keeps this store's ephemeral entries alive (etcd: one lease keepalive). `Ok(true)` means
    /// the service lost them (lease expired or unknown) and they must be published again.
    fn keepalive(&self) -> Result<bool> {
        Ok(false)
    }
    /// Releases what the store holds on the service (etcd: revokes the lease).
    fn close(&self) {}
}

/// [`MetadataStore::create`] by a look then a put (not atomic: the default, and what a
/// backend without a create-if-absent does for keys nothing else creates).
pub(crate) fn create_by_look(
    store: &(impl MetadataStore + ?Sized),
    key: &str,
    value: &[u8],
) -> Result<bool> {
    match store.get(key)? {
        Some(v) => Ok(v == value),
        None => store.put(key, value).map(|()| true),
    }
}

/// [`MetadataStore::remove_if`] by a look, a compare of the value and a remove (not
/// atomic: the default, and what HTTP does against a server that names no write).
pub(crate) fn remove_by_look(
    store: &(impl MetadataStore + ?Sized),
    key: &str,
    seen: &Seen,
) -> Result<bool> {
    match store.get(key)? {
        Some(v) if v == seen.value => store.remove(key).map(|()| true),
        _ => Ok(false),
    }
}

/// Whether `key` is an `rpc_meta` entry of [`Keys`]' layout (what names an engine).
pub(crate) fn is_rpc_meta(key: &str) -> bool {
    key.contains("/rpc_meta/")
}

/// Opens the backend a connection string names; `None` for `P2PHANDSHAKE`.
pub fn connect(conn: &str, opts: &StoreOptions) -> Result<Option<Arc<dyn MetadataStore>>> {
    Ok(match ConnString::parse(conn)? {
        ConnString::P2p => None,
        ConnString::Http { url } => Some(Arc::new(http::HttpStore::new(&url, opts)?)),
        ConnString::Etcd { endpoints } => {
            Some(Arc::new(etcd::EtcdStore::connect(&endpoints, opts)?))
        }
        ConnString::Redis {
            host,
            port,
            username,
            password,
            db,
        } => Some(Arc::new(redis::RedisStore::new(
            &host,
            port,
            username.or_else(|| opts.redis_username.clone()),
            password.or_else(|| opts.redis_password.clone()),
            db.or(opts.redis_db),
            opts,
        )?)),
    })
}

/// `mooncake/rpc_meta/<name>`: where a segment's handshake port is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RpcMeta {
    pub ip_or_host_name: String,
    pub rpc_port: u16,
}

/// Mooncake's key layout, with the optional cluster-id namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(cluster_id: Option<&str>) -> Keys {
        let prefix = match cluster_id
            .map(|c| c.trim().trim_matches('/'))
            .filter(|c| !c.is_empty())
        {
            Some(id) => format!("mooncake/{id}/"),
            None => "mooncake/".to_string(),
        };
        Keys { prefix }
    }

    fn key(&self, kind: &str, name: &str) -> String {
        // Mooncake: a name that already contains '/' is used as is after the prefix.
        if name.contains('/') {
            format!("{}{name}", self.prefix)
        } else {
            format!("{}{kind}/{name}", self.prefix)
        }
    }

    pub fn rpc_meta(&self, name: &str) -> String {
        self.key("rpc_meta", name)
    }

    pub fn ram(&self, name: &str) -> String {
        self.key("ram", name)
    }
}

/// An `rpc_meta` value: Mooncake's two fields, and `kvferry_write`, this write's random
/// number (16 hex digits; ignored by Mooncake and by [`decode_rpc_meta`]).
pub(crate) fn encode_rpc_meta(meta: &RpcMeta, write: u64) -> Result<Vec<u8>> {
    serde_json::to_vec(&serde_json::json!({
        "ip_or_host_name": meta.ip_or_host_name,
        "rpc_port": meta.rpc_port,
        "kvferry_write": format!("{write:016x}"),
    }))
    .map_err(|e| Error::InvalidArgument(e.to_string()))
}

/// Decodes an `rpc_meta` value; the error names the missing or bad field.
pub fn decode_rpc_meta(value: &[u8]) -> std::result::Result<RpcMeta, String> {
    let v: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| format!("rpc_meta is not JSON: {e}"))?;
    let host = v
        .get("ip_or_host_name")
        .and_then(|h| h.as_str())
        .ok_or("rpc_meta lacks the string field \"ip_or_host_name\"")?;
    if host.is_empty() {
        return Err("rpc_meta field \"ip_or_host_name\" is empty".into());
    }
    let port = v
        .get("rpc_port")
        .and_then(|p| p.as_u64())
        .ok_or("rpc_meta lacks the integer field \"rpc_port\"")?;
    let port = u16::try_from(port).ok().filter(|p| *p != 0).ok_or(format!(
        "rpc_meta field \"rpc_port\" = {port} is not a port"
    ))?;
    Ok(RpcMeta {
        ip_or_host_name: host.to_string(),
        rpc_port: port,
    })
}

/// One entry an engine owns in the service.
struct Entry {
    value: Vec<u8>,
    /// Not (or no longer) in the service: the keeper puts it.
    pending: bool,
}

/// The entries one engine owns in the service.
#[derive(Default)]
struct Owned {
    entries: BTreeMap<String, Entry>,
}

/// An engine's view of the metadata service: look-ups by segment name, and its own entries,
/// kept alive and re-published by a keeper thread.
pub struct Directory {
    store: Arc<dyn MetadataStore>,
    keys: Keys,
    owned: Mutex<Owned>,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    keeper: Mutex<Option<std::thread::JoinHandle<()>>>,
    closed: AtomicBool,
}

impl Directory {
    pub fn new(store: Arc<dyn MetadataStore>, keys: Keys) -> Arc<Directory> {
        Arc::new(Directory {
            store,
            keys,
            owned: Mutex::default(),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            keeper: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }

    /// "etcd (127.0.0.1:2379)" for messages.
    pub(crate) fn describe(&self) -> String {
        format!("{} ({})", self.store.backend(), self.store.location())
    }

    /// Publishes `value` under `key` and remembers it for re-publishing.
    pub fn publish(&self, key: &str, value: Vec<u8>) -> Result<()> {
        self.publish_with(key, || value)
    }

    /// Like [`Directory::publish`], the value computed while holding the publish lock, so
    /// concurrent publishers of one key cannot leave an older value in the service.
    pub(crate) fn publish_with(&self, key: &str, value: impl FnOnce() -> Vec<u8>) -> Result<()> {
        let mut owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
        let value = value();
        let r = self.store.put(key, &value);
        owned.entries.insert(
            key.to_string(),
            Entry {
                value,
                pending: r.is_err(),
            },
        );
        r
    }

    /// Publishes this engine's rpc_meta. An entry already there is replaced only when the
    /// engine it names no longer answers (`alive` returns false) or it names this engine's
    /// address (its own, e.g. left by a crash): a restarted engine reuses its name, a live one
    /// keeps it.
    ///
    /// The entry is created only if absent ([`MetadataStore::create`]), and a dead engine's
    /// entry removed only if unchanged ([`MetadataStore::remove_if`]): of engines starting
    /// under one name at the same instant, or replacing the same dead one, one gets it and
    /// the others find a live engine there (over HTTP, replacing a dead one, see `remove_if`).
    ///
    /// The value written carries a random `kvferry_write` (Mooncake reads only the address
    /// fields), so every write is told apart from an identical earlier one even where the
    /// service compares by value (Redis's `remove_if`, `create`): a removal of a dead
    /// engine's entry that was seen before the engine restarted at the same address and
    /// wrote it again no longer takes the new one. This engine's own leftover is recognised
    /// by its address, not by its bytes.
    pub fn publish_rpc_meta(
        &self,
        name: &str,
        meta: &RpcMeta,
        alive: &dyn Fn(&RpcMeta) -> bool,
    ) -> Result<()> {
        let key = self.keys.rpc_meta(name);
        let value = encode_rpc_meta(meta, rand::random())?;
        let refused = |why: String| Error::Metadata {
            backend: self.store.backend().name(),
            location: self.store.location().to_string(),
            reason: why,
        };
        // Each round either creates the entry, finds it live, or removes a dead one (which
        // another engine may then take first: then the next round finds it live).
        for _ in 0..4 {
            if let Some(seen) = self.store.get_seen(&key)? {
                let old = &seen.value;
                match decode_rpc_meta(old) {
                    Ok(m) if m != *meta && alive(&m) => {
                        return Err(refused(format!(
                            "segment name {name:?} is already registered by a live engine at {}:{}; give this engine another local_hostname (central mode uses it as the segment name) or stop the other one",
                            m.ip_or_host_name, m.rpc_port
                        )))
                    }
                    _ => {
                        // Mooncake's HTTP servers refuse to overwrite an rpc_meta entry, and one
                        // naming this engine's address (its own, left by a crash) may be under
                        // an etcd lease about to expire: remove it.
                        tracing::info!(segment = name, "replacing an rpc_meta entry whose engine no longer answers");
                        // (Not removed if it was written again meanwhile: another engine
                        // replaced it, or its own restarted.)
                        self.store.remove_if(&key, &seen)?;
                    }
                }
            }
            let mut owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
            if self.store.create(&key, &value)? {
                owned.entries.insert(
                    key,
                    Entry {
                        value,
                        pending: false,
                    },
                );
                return Ok(());
            }
        }
        Err(refused(format!("segment name {name:?}: its rpc_meta entry kept changing while this engine registered (several engines starting under this name?); give each engine its own local_hostname")))
    }

    /// Publishes this engine's segment descriptor (`ram/<name>`), computed under the lock.
    pub(crate) fn publish_segment(
        &self,
        name: &str,
        desc: impl FnOnce() -> SegmentDesc,
    ) -> Result<()> {
        self.publish_with(&self.keys.ram(name), || desc().encode())
    }

    /// Removes every entry this directory published and releases its lease. Idempotent.
    pub fn withdraw_all(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stop_keeper();
        let owned = std::mem::take(&mut *self.owned.lock().unwrap_or_else(|e| e.into_inner()));
        // ram before rpc_meta, the reverse of registration.
        let mut keys: Vec<&String> = owned.entries.keys().collect();
        keys.sort_by_key(|k| !k.contains("/ram/"));
        for k in keys {
            if let Err(e) = self.store.remove(k) {
                tracing::warn!("removing {k} from {}: {e}", self.describe());
            }
        }
        self.store.close();
    }

    fn not_registered(&self, name: &str, key: String) -> Error {
        Error::SegmentNotRegistered {
            name: name.to_string(),
            backend: self.store.backend().name(),
            location: self.store.location().to_string(),
            key,
        }
    }

    /// Where segment `name`'s handshake port is.
    pub fn fetch_rpc_meta(&self, name: &str) -> Result<RpcMeta> {
        let key = self.keys.rpc_meta(name);
        let v = self
            .store
            .get(&key)?
            .ok_or_else(|| self.not_registered(name, key.clone()))?;
        decode_rpc_meta(&v).map_err(|reason| Error::BadMetadata { key, reason })
    }

    /// Segment `name`'s descriptor, validated.
    pub fn fetch_segment(&self, name: &str) -> Result<SegmentDesc> {
        let key = self.keys.ram(name);
        let v = self
            .store
            .get(&key)?
            .ok_or_else(|| self.not_registered(name, key.clone()))?;
        SegmentDesc::decode(&v).map_err(|e| Error::BadMetadata {
            key,
            reason: e.to_string(),
        })
    }

    /// Puts every owned entry marked pending (rpc_meta first, as at registration).
    fn republish(&self) -> Result<usize> {
        let mut owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
        let mut first_err = None;
        let mut done = 0;
        let mut keys: Vec<String> = owned
            .entries
            .iter()
            .filter(|(_, e)| e.pending)
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_by_key(|k| !is_rpc_meta(k));
        for k in keys {
            let Some(e) = owned.entries.get_mut(&k) else {
                continue;
            };
            // The name only if no other engine took it meanwhile (created, not put: between
            // `maintain`'s look and this put another engine may have registered it).
            let put = if is_rpc_meta(&k) {
                self.store.create(&k, &e.value)
            } else {
                self.store.put(&k, &e.value).map(|()| true)
            };
            match put {
                Ok(true) => {
                    e.pending = false;
                    done += 1;
                }
                Ok(false) => {
                    tracing::error!(
                        "{}: segment name {k} was registered by another engine while this engine's entries were lost; this engine withdraws from the service (peers can no longer find it: restart it, or give it another local_hostname)",
                        self.describe()
                    );
                    owned.entries.clear();
                    return Ok(done);
                }
                Err(err) => {
                    first_err.get_or_insert(err);
                }
            }
        }
        first_err.map_or(Ok(done), Err)
    }

    /// One keeper round: lease keepalive; if the service lost this engine's entries (lease
    /// gone, or its rpc_meta absent: a service restarted without its data), mark them all for
    /// re-publishing; then put whatever is pending (including publishes that failed earlier).
    /// Returns how many entries were put.
    pub fn maintain(&self) -> Result<usize> {
        let lost = self.store.keepalive()?;
        let rpc = {
            let owned = self.owned.lock().unwrap_or_else(|e| e.into_inner());
            owned
                .entries
                .iter()
                .find(|(k, _)| is_rpc_meta(k))
                .map(|(k, e)| (k.clone(), e.value.clone(), e.pending))
        };
        let mut missing = false;
        if let Some((k, ours, pending)) = rpc {
            match self.store.get(&k)? {
                // Another engine took the name while this one's entries were gone (its lease
                // ran out: cut off from the service longer than the TTL): it keeps it. Putting
                // ours back would point peers at this engine under the other's name.
                Some(v) if v != ours => {
                    let other = decode_rpc_meta(&v)
                        .map(|m| format!("{}:{}", m.ip_or_host_name, m.rpc_port))
                        .unwrap_or_else(|e| e);
                    tracing::error!(
                        "{}: segment name {} is now registered by another engine ({other}) since this engine's entries were lost; this engine withdraws from the service (peers can no longer find it: restart it, or give it another local_hostname)",
                        self.describe(),
                        k
                    );
                    self.owned
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entries
                        .clear();
                    return Ok(0);
                }
                Some(_) => {}
                None => missing = !pending,
            }
        }
        if lost || missing {
            tracing::info!(
                "{}: this engine's entries are gone (lease lost: {lost}); publishing them again",
                self.describe()
            );
            for e in self
                .owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entries
                .values_mut()
            {
                e.pending = true;
            }
        }
        self.republish()
    }

    /// Starts the keeper thread: [`Directory::maintain`] every `period`.
    pub(crate) fn start_keeper(self: &Arc<Self>, period: Duration) -> Result<()> {
        let weak = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("kvf-meta-keeper".into())
            .spawn(move || loop {
                let Some(d) = weak.upgrade() else { return };
                {
                    let stop = d.stop.lock().unwrap_or_else(|e| e.into_inner());
                    let (stop, _) = d
                        .stop_cv
                        .wait_timeout_while(stop, period, |s| !*s)
                        .unwrap_or_else(|e| e.into_inner());
                    if *stop {
                        return;
                    }
                }
                match d.maintain() {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(
                        "metadata keeper: published {n} entries again in {}",
                        d.describe()
                    ),
                    Err(e) => tracing::warn!("metadata keeper: {e}"),
                }
            })
            .map_err(|e| Error::io("starting the metadata keeper thread", e))?;
        *self.keeper.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(())
    }

    fn stop_keeper(&self) {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.stop_cv.notify_all();
        if let Some(h) = self.keeper.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        self.stop_keeper();
    }
}

/// Percent-encodes a query value the way curl_easy_escape does (RFC 3986 unreserved kept).
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings() {
        assert_eq!(ConnString::parse("P2PHANDSHAKE").unwrap(), ConnString::P2p);
        assert_eq!(
            ConnString::parse("http://127.0.0.1:8080/metadata").unwrap(),
            ConnString::Http {
                url: "http://127.0.0.1:8080/metadata".into()
            }
        );
        assert_eq!(
            ConnString::parse("etcd://h1:2379,h2:2379").unwrap(),
            ConnString::Etcd {
                endpoints: vec!["h1:2379".into(), "h2:2379".into()]
            }
        );
        assert_eq!(
            ConnString::parse("10.0.0.1:2379").unwrap(),
            ConnString::Etcd {
                endpoints: vec!["10.0.0.1:2379".into()]
            }
        );
        assert_eq!(
            ConnString::parse("redis://u:p@h:6380/3").unwrap(),
            ConnString::Redis {
                host: "h".into(),
                port: 6380,
                username: Some("u".into()),
                password: Some("p".into()),
                db: Some(3)
            }
        );
        assert_eq!(
            ConnString::parse("redis://:secret@h:6379").unwrap(),
            ConnString::Redis {
                host: "h".into(),
                port: 6379,
                username: None,
                password: Some("secret".into()),
                db: None
            }
        );
        assert_eq!(
            ConnString::parse("redis://h:1").unwrap().backend(),
            Some(Backend::Redis)
        );
        let e = ConnString::parse("zk://h:2181").unwrap_err().to_string();
        assert!(
            e.contains("unknown scheme \"zk\"")
                && e.contains("etcd://")
                && e.contains("redis://")
                && e.contains("http://")
                && e.contains("P2PHANDSHAKE"),
            "{e}"
        );
        assert!(ConnString::parse("redis://h:1/999")
            .unwrap_err()
            .to_string()
            .contains("0-255"));
        assert!(ConnString::parse("nohostport").is_err());
        assert!(ConnString::parse("").is_err());
        assert_eq!(
            ConnString::parse("https://h/metadata").unwrap(),
            ConnString::Http {
                url: "https://h/metadata".into()
            }
        );
        assert_eq!(
            ConnString::parse("HTTPS://h:8443/metadata")
                .unwrap()
                .backend(),
            Some(Backend::Http)
        );
        assert!(ConnString::parse("https://:8443/metadata").is_err());
    }

    #[test]
    fn key_layout() {
        let k = Keys::new(None);
        assert_eq!(k.rpc_meta("node1"), "mooncake/rpc_meta/node1");
        assert_eq!(k.ram("10.0.0.5:12345"), "mooncake/ram/10.0.0.5:12345");
        assert_eq!(k.ram("nvmeof/x"), "mooncake/nvmeof/x");
        let k = Keys::new(Some("prod"));
        assert_eq!(k.ram("n"), "mooncake/prod/ram/n");
        assert_eq!(Keys::new(Some("  ")), Keys::new(None));
    }

    #[test]
    fn rpc_meta_fields_are_named() {
        assert_eq!(
            decode_rpc_meta(br#"{"ip_or_host_name":"10.0.0.1","rpc_port":15001}"#)
                .unwrap()
                .rpc_port,
            15001
        );
        assert!(decode_rpc_meta(br#"{"rpc_port":1}"#)
            .unwrap_err()
            .contains("ip_or_host_name"));
        assert!(decode_rpc_meta(br#"{"ip_or_host_name":"h"}"#)
            .unwrap_err()
            .contains("rpc_port"));
        assert!(
            decode_rpc_meta(br#"{"ip_or_host_name":"h","rpc_port":70000}"#)
                .unwrap_err()
                .contains("rpc_port")
        );
        assert!(decode_rpc_meta(b"garbage")
            .unwrap_err()
            .contains("not JSON"));
        // Extra fields and a trailing newline (etcd/redis writers) are fine.
        assert!(decode_rpc_meta(b"{\"ip_or_host_name\":\"h\",\"rpc_port\":2,\"x\":1}\n").is_ok());
    }

    #[test]
    fn encoding() {
        assert_eq!(
            url_encode("mooncake/ram/a b:1"),
            "mooncake%2Fram%2Fa%20b%3A1"
        );
    }
}
