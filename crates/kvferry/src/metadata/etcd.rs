//! etcd v3 backend over etcd's JSON gateway (`POST /v3/kv/range`, `/v3/kv/put`,
//! `/v3/lease/grant` ..., served on the client port by every etcd since 3.4), with the blocking
//! HTTP client the HTTP backend uses. No gRPC code is generated at build time (so no `protoc`),
//! and no async runtime runs: a call is one HTTP request, bounded by the configured timeout,
//! tried on each endpoint in turn when one cannot be reached.
//!
//! Entries are put under one lease per store (TTL `KVFERRY_METADATA_LEASE_TTL`). The engine's
//! keeper calls [`MetadataStore::keepalive`] every third of the TTL; when etcd no longer knows
//! the lease (it expired while the engine was cut off, or etcd lost its data) a new one is
//! granted and the keeper re-publishes. A crashed engine stops renewing, so its entries vanish
//! by themselves after the TTL. [`MetadataStore::close`] revokes the lease.

use super::{Backend, MetadataStore, Seen, StoreOptions};
use crate::error::{Error, Result};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Largest answer accepted (a descriptor of ~100k buffers, base64-encoded).
const MAX_ANSWER: u64 = 192 << 20;

pub(crate) struct EtcdStore {
    client: EtcdClient,
    ttl: i64,
    lease: Mutex<Option<i64>>,
}

/// A blocking etcd v3 client over the JSON gateway: the calls the metadata backend and the
/// store's leader election (`kvferry_store::ha`) need. Every call is one HTTP request bounded
/// by the timeout given at construction, tried on each endpoint in turn while one cannot be
/// reached.
pub struct EtcdClient {
    location: String,
    endpoints: Vec<String>,
    agent: ureq::Agent,
    /// The endpoint that answered last (tried first).
    current: AtomicUsize,
}

/// One key as etcd holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub value: Vec<u8>,
    /// Revision of the transaction that created the key (monotonic while etcd keeps its data:
    /// a key deleted and created again gets a larger one; an etcd that lost its data counts
    /// from 1 again, so a revision alone does not name one creation: see [`Owner`]).
    pub create_revision: i64,
    pub mod_revision: i64,
    /// The lease the key lives under (0: none).
    pub lease: i64,
}

/// One creation of a key by one holder: its create revision and the lease it lives under.
/// Revisions repeat after etcd lost its data (a fresh etcd counts from 1 again) and a lease
/// is granted to one holder only, so the pair still names this creation after a wipe, where
/// the revision alone may name a newer holder's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub create_revision: i64,
    pub lease: i64,
}

impl Owner {
    /// The creation `kv` is.
    pub fn of(kv: &KeyValue) -> Owner {
        Owner {
            create_revision: kv.create_revision,
            lease: kv.lease,
        }
    }

    /// Whether `kv` is this creation.
    pub fn holds(&self, kv: &KeyValue) -> bool {
        Owner::of(kv) == *self
    }

    /// The transaction compares that hold only while `key` is this creation.
    fn compares(&self, key: &str) -> Value {
        let k = B64.encode(key);
        json!([
            { "key": k, "result": "EQUAL", "target": "CREATE", "create_revision": self.create_revision.to_string() },
            { "key": k, "result": "EQUAL", "target": "LEASE", "lease": self.lease.to_string() },
        ])
    }
}

/// A condition of a transaction ([`EtcdClient::create_when`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cond {
    /// The key's last modification is this revision (0: the key does not exist).
    ModRevision(String, i64),
    /// The key does not exist.
    Absent(String),
}

impl Cond {
    fn compare(&self) -> Value {
        match self {
            Cond::ModRevision(key, rev) => {
                json!({ "key": B64.encode(key), "result": "EQUAL", "target": "MOD", "mod_revision": rev.to_string() })
            }
            Cond::Absent(key) => {
                json!({ "key": B64.encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0" })
            }
        }
    }
}

/// The outcome of [`EtcdClient::create`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    /// The key did not exist and now holds the value; its create revision.
    Won(i64),
    /// The key existed (what it holds, if it was still there when read back).
    Lost(Option<KeyValue>),
}

/// Endpoints of an etcd connection string as Mooncake writes them: `etcd://h1:2379;h2:2379`,
/// `h1:2379,h2:2379`, with or without the scheme, `;` or `,` between endpoints.
pub fn parse_endpoints(s: &str) -> Vec<String> {
    let s = s.trim();
    let s = s.strip_prefix("etcd://").unwrap_or(s);
    s.split([';', ','])
        .map(|e| {
            e.trim()
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string()
        })
        .filter(|e| !e.is_empty())
        .collect()
}

/// An int64 of the gateway's JSON (proto3 maps int64 to a string; accept a number too).
fn int(v: &Value) -> Option<i64> {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| v.as_i64())
}

impl EtcdClient {
    /// A client of `endpoints` (`host:port`), each call bounded by `timeout` (connecting by
    /// half of it, at most 1.5 s). Nothing is sent yet.
    pub fn new(endpoints: &[String], timeout: Duration) -> EtcdClient {
        let connect = (timeout / 2)
            .min(Duration::from_millis(1500))
            .max(Duration::from_millis(10));
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .timeout_connect(Some(connect))
            .max_idle_connections_per_host(4)
            .user_agent("kvferry")
            .build();
        EtcdClient {
            location: format!("etcd://{}", endpoints.join(",")),
            endpoints: endpoints.to_vec(),
            agent: ureq::Agent::new_with_config(config),
            current: AtomicUsize::new(0),
        }
    }

    /// Like [`EtcdClient::new`], failing now, with the reason, if no endpoint answers.
    pub fn connect(endpoints: &[String], timeout: Duration) -> Result<EtcdClient> {
        let c = EtcdClient::new(endpoints, timeout);
        c.call("connecting", "/v3/maintenance/status", json!({}))?;
        Ok(c)
    }

    /// `etcd://h1,h2`: the endpoints, for messages.
    pub fn location(&self) -> &str {
        &self.location
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata {
            backend: Backend::Etcd.name(),
            location: self.location.clone(),
            reason,
        }
    }

    /// One gateway call: `body` posted to `path` on the endpoint that answered last, then on
    /// the others while they cannot be reached. An answer other than 200 is etcd's error (not
    /// retried elsewhere); its message is in the error.
    fn call(&self, what: &str, path: &str, body: Value) -> Result<Value> {
        let n = self.endpoints.len().max(1);
        let first = self.current.load(Ordering::Relaxed);
        let bytes = body.to_string();
        let mut last = String::new();
        for k in 0..n {
            let i = (first + k) % n;
            let Some(ep) = self.endpoints.get(i) else {
                break;
            };
            let resp = self
                .agent
                .post(&format!("http://{ep}{path}"))
                .header("content-type", "application/json")
                .send(bytes.as_bytes());
            let resp = match resp {
                Ok(r) => r,
                Err(e) => {
                    last = format!("{ep}: {e}");
                    continue;
                }
            };
            self.current.store(i, Ordering::Relaxed);
            let status = resp.status().as_u16();
            let mut buf = Vec::new();
            resp.into_body()
                .into_reader()
                .take(MAX_ANSWER + 1)
                .read_to_end(&mut buf)
                .map_err(|e| self.err(format!("{what}: reading the answer: {e}")))?;
            // A streaming call (lease keepalive) answers one JSON object per line.
            let first_line = buf.split(|&b| b == b'\n').next().unwrap_or(&[]);
            let v: Value = serde_json::from_slice(first_line).map_err(|e| self.err(format!("{what}: the answer is not JSON ({e}): is {ep} an etcd (3.4 or newer) client port?")))?;
            if status != 200 || v.get("error").is_some() {
                let msg = v
                    .get("message")
                    .or_else(|| v.get("error"))
                    .and_then(Value::as_str)
                    .unwrap_or("unknown error");
                return Err(self.err(format!("{what}: {msg} (HTTP {status})")));
            }
            return Ok(v);
        }
        Err(self.err(format!(
            "{what}: no endpoint answered ({last}); is etcd running and reachable at this address?"
        )))
    }

    /// Grants a lease of `ttl_secs`; its id and the TTL etcd granted (etcd may raise a TTL
    /// below its minimum).
    pub fn lease_grant(&self, ttl_secs: i64) -> Result<(i64, i64)> {
        let v = self.call(
            "granting a lease",
            "/v3/lease/grant",
            json!({ "TTL": ttl_secs }),
        )?;
        let id = v
            .get("ID")
            .and_then(int)
            .ok_or_else(|| self.err(format!("granting a lease: no ID in the answer {v}")))?;
        Ok((id, v.get("TTL").and_then(int).unwrap_or(ttl_secs)))
    }

    /// Renews a lease; its remaining TTL, `None` when etcd no longer knows it (expired or
    /// revoked).
    pub fn lease_keepalive(&self, id: i64) -> Result<Option<i64>> {
        match self.call(
            "renewing the lease",
            "/v3/lease/keepalive",
            json!({ "ID": id.to_string() }),
        ) {
            // {"result": {"ID": ..., "TTL": ...}}; an expired lease comes back without a TTL.
            Ok(v) => Ok(Some(
                v.get("result")
                    .unwrap_or(&v)
                    .get("TTL")
                    .and_then(int)
                    .unwrap_or(0),
            )
            .filter(|t| *t > 0)),
            Err(e) if lease_gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A lease's remaining TTL without renewing it; `None` when etcd no longer knows it
    /// (expired or revoked).
    pub fn lease_ttl(&self, id: i64) -> Result<Option<i64>> {
        match self.call(
            "reading a lease's TTL",
            "/v3/lease/timetolive",
            json!({ "ID": id.to_string() }),
        ) {
            // {"ID": ..., "TTL": ...}: -1 (or absent) for a lease etcd does not know.
            Ok(v) => Ok(v.get("TTL").and_then(int).filter(|t| *t > 0)),
            Err(e) if lease_gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Revokes a lease (its keys go with it); an unknown lease is not an error.
    pub fn lease_revoke(&self, id: i64) -> Result<()> {
        match self.call(
            "revoking the lease",
            "/v3/lease/revoke",
            json!({ "ID": id.to_string() }),
        ) {
            Err(e) if !lease_gone(&e) => Err(e),
            _ => Ok(()),
        }
    }

    fn decode_kv(&self, key: &str, kv: &Value) -> Result<KeyValue> {
        // Zero values and empty strings are omitted from the JSON.
        let value = kv.get("value").and_then(Value::as_str).unwrap_or("");
        let value = B64
            .decode(value)
            .map_err(|e| self.err(format!("GET {key}: the value is not base64 ({e})")))?;
        let f = |n: &str| kv.get(n).and_then(int).unwrap_or(0);
        Ok(KeyValue {
            value,
            create_revision: f("create_revision"),
            mod_revision: f("mod_revision"),
            lease: f("lease"),
        })
    }

    /// `key` with its revisions and lease, `None` when absent.
    pub fn get_kv(&self, key: &str) -> Result<Option<KeyValue>> {
        let v = self.call(
            &format!("GET {key}"),
            "/v3/kv/range",
            json!({ "key": B64.encode(key) }),
        )?;
        match v
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        {
            Some(kv) => self.decode_kv(key, kv).map(Some),
            None => Ok(None),
        }
    }

    /// Sets `key` under `lease` (0: none).
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<()> {
        let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        self.call(&format!("PUT {key}"), "/v3/kv/put", body)
            .map(drop)
    }

    /// Creates `key` = `value` under `lease` in one transaction, only if it does not exist
    /// (compare `create_revision == 0`).
    pub fn create(&self, key: &str, value: &[u8], lease: i64) -> Result<Created> {
        self.create_when(key, value, lease, &[])
    }

    /// [`EtcdClient::create`], and only while every one of `conds` holds too (in the same
    /// transaction). When a condition fails but the key is absent, the answer is
    /// `Created::Lost(None)`.
    pub fn create_when(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        conds: &[Cond],
    ) -> Result<Created> {
        let k = B64.encode(key);
        let mut put = json!({ "key": k, "value": B64.encode(value) });
        if lease != 0 {
            put["lease"] = json!(lease.to_string());
        }
        let mut compare = vec![
            json!({ "key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0" }),
        ];
        compare.extend(conds.iter().map(Cond::compare));
        let body = json!({
            "compare": compare,
            "success": [{ "request_put": put }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let v = self.call(&format!("CREATE {key}"), "/v3/kv/txn", body)?;
        if v.get("succeeded").and_then(Value::as_bool).unwrap_or(false) {
            let rev = v
                .get("header")
                .and_then(|h| h.get("revision"))
                .and_then(int)
                .ok_or_else(|| self.err(format!("CREATE {key}: no revision in the answer {v}")))?;
            return Ok(Created::Won(rev));
        }
        let kv = v
            .get("responses")
            .and_then(Value::as_array)
            .and_then(|r| r.first())
            .and_then(|r| r.get("response_range"))
            .and_then(|r| r.get("kvs"))
            .and_then(Value::as_array)
            .and_then(|a| a.first());
        match kv {
            Some(kv) => self.decode_kv(key, kv).map(|kv| Created::Lost(Some(kv))),
            None => Ok(Created::Lost(None)),
        }
    }

    /// Deletes `key` only if it is still `owner`'s creation; whether it was.
    pub fn delete_if_owned(&self, key: &str, owner: Owner) -> Result<bool> {
        let body = json!({
            "compare": owner.compares(key),
            "success": [{ "request_delete_range": { "key": B64.encode(key) } }],
        });
        let v = self.call(&format!("DELETE {key}"), "/v3/kv/txn", body)?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// One transaction guarded by `guard` still being `owner`'s creation (an HA leader's view
    /// key): `puts` set, then the keys in `[delete.0, delete.1)` removed. `Some(revision)` when
    /// it was applied, `None` when the guard failed (nothing changed).
    pub fn txn_if_owned(
        &self,
        guard: &str,
        owner: Owner,
        puts: &[(String, Vec<u8>)],
        delete: Option<(&str, &str)>,
    ) -> Result<Option<i64>> {
        let mut ops: Vec<Value> = puts
            .iter()
            .map(
                |(k, v)| json!({ "request_put": { "key": B64.encode(k), "value": B64.encode(v) } }),
            )
            .collect();
        if let Some((from, to)) = delete {
            ops.push(json!({ "request_delete_range": { "key": B64.encode(from), "range_end": B64.encode(to) } }));
        }
        let body = json!({
            "compare": owner.compares(guard),
            "success": ops,
        });
        let what = format!("TXN guarded by {guard}");
        let v = self.call(&what, "/v3/kv/txn", body)?;
        if !v.get("succeeded").and_then(Value::as_bool).unwrap_or(false) {
            return Ok(None);
        }
        let rev = v
            .get("header")
            .and_then(|h| h.get("revision"))
            .and_then(int)
            .ok_or_else(|| self.err(format!("{what}: no revision in the answer {v}")))?;
        Ok(Some(rev))
    }

    /// Every key in `[from, to)` in key order with its value, read `page` keys per request.
    pub fn range(&self, from: &str, to: &str, page: usize) -> Result<Vec<(String, KeyValue)>> {
        let mut out = Vec::new();
        let mut start = from.as_bytes().to_vec();
        loop {
            let what = format!("RANGE {from}..{to}");
            let v = self.call(&what, "/v3/kv/range", json!({ "key": B64.encode(&start), "range_end": B64.encode(to), "limit": page.max(1).to_string() }))?;
            let kvs = v
                .get("kvs")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for kv in &kvs {
                let key = kv
                    .get("key")
                    .and_then(Value::as_str)
                    .map(|k| B64.decode(k))
                    .transpose()
                    .map_err(|e| self.err(format!("{what}: a key is not base64 ({e})")))?
                    .unwrap_or_default();
                let key = String::from_utf8(key)
                    .map_err(|e| self.err(format!("{what}: a key is not UTF-8 ({e})")))?;
                let decoded = self.decode_kv(&key, kv)?;
                out.push((key, decoded));
            }
            let more = v.get("more").and_then(Value::as_bool).unwrap_or(false);
            match out.last() {
                Some((last, _)) if more && !kvs.is_empty() => {
                    start = last.as_bytes().to_vec();
                    start.push(0);
                }
                _ => return Ok(out),
            }
        }
    }

    /// Compacts etcd's history up to `revision` (old versions of every key are dropped, so
    /// the database does not grow with every rewrite of the same keys).
    pub fn compact(&self, revision: i64) -> Result<()> {
        match self.call(
            "compacting",
            "/v3/kv/compaction",
            json!({ "revision": revision.to_string() }),
        ) {
            // Compacted already (by etcd's auto-compaction or another caller): fine.
            Err(e) if e.to_string().contains("compacted") => Ok(()),
            r => r.map(drop),
        }
    }

    /// Removes every key in `[from, to)`.
    pub fn delete_range(&self, from: &str, to: &str) -> Result<()> {
        self.call(
            &format!("DELETE {from}..{to}"),
            "/v3/kv/deleterange",
            json!({ "key": B64.encode(from), "range_end": B64.encode(to) }),
        )
        .map(drop)
    }

    /// Removes `key`; absent is not an error.
    pub fn delete(&self, key: &str) -> Result<()> {
        self.call(
            &format!("DELETE {key}"),
            "/v3/kv/deleterange",
            json!({ "key": B64.encode(key) }),
        )
        .map(drop)
    }

    /// Deletes `key` only if its last write is `mod_revision` (one transaction); whether it
    /// did.
    pub(crate) fn delete_if_revision(&self, key: &str, mod_revision: i64) -> Result<bool> {
        let k = B64.encode(key);
        let body = json!({
            "compare": [Cond::ModRevision(key.to_string(), mod_revision).compare()],
            "success": [{ "request_delete_range": { "key": k } }],
        });
        let v = self.call(
            &format!("DELETE {key} (if not written since)"),
            "/v3/kv/txn",
            body,
        )?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// Deletes `key` only if it holds `value` (one transaction); whether it did.
    pub(crate) fn delete_if_value(&self, key: &str, value: &[u8]) -> Result<bool> {
        let k = B64.encode(key);
        let body = json!({
            "compare": [{ "key": k, "result": "EQUAL", "target": "VALUE", "value": B64.encode(value) }],
            "success": [{ "request_delete_range": { "key": k } }],
        });
        let v = self.call(&format!("DELETE {key} (if unchanged)"), "/v3/kv/txn", body)?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }
}

impl EtcdStore {
    pub(crate) fn connect(endpoints: &[String], opts: &StoreOptions) -> Result<EtcdStore> {
        let client = EtcdClient::connect(endpoints, opts.timeout)?;
        Ok(EtcdStore {
            client,
            ttl: opts.lease_ttl.as_secs().max(2) as i64,
            lease: Mutex::new(None),
        })
    }

    fn grant(&self) -> Result<i64> {
        self.client.lease_grant(self.ttl).map(|(id, _)| id)
    }

    /// The current lease, granted on first use.
    fn lease(&self) -> Result<i64> {
        let mut l = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        match *l {
            Some(id) => Ok(id),
            None => {
                let id = self.grant()?;
                *l = Some(id);
                Ok(id)
            }
        }
    }
}

fn lease_gone(e: &Error) -> bool {
    matches!(e, Error::Metadata { reason, .. } if reason.contains("lease not found"))
}

impl MetadataStore for EtcdStore {
    fn backend(&self) -> Backend {
        Backend::Etcd
    }

    fn location(&self) -> &str {
        self.client.location()
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.client.get_kv(key).map(|kv| kv.map(|kv| kv.value))
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let lease = self.lease()?;
        match self.client.put(key, value, lease) {
            Err(e) if lease_gone(&e) => {
                // The lease vanished (etcd lost its data, or it expired): take a new one.
                let id = self.grant()?;
                *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
                self.client.put(key, value, id)
            }
            r => r,
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.client.delete(key)
    }

    fn get_seen(&self, key: &str) -> Result<Option<Seen>> {
        self.client.get_kv(key).map(|kv| {
            kv.map(|kv| Seen {
                value: kv.value,
                revision: Some(kv.mod_revision),
            })
        })
    }

    /// One transaction comparing the write (`mod_revision`) when `seen` has it, else the value.
    fn remove_if(&self, key: &str, seen: &Seen) -> Result<bool> {
        match seen.revision {
            Some(rev) => self.client.delete_if_revision(key, rev),
            None => self.client.delete_if_value(key, &seen.value),
        }
    }

    /// One transaction: created under this store's lease if absent (`create_revision == 0`).
    fn create(&self, key: &str, value: &[u8]) -> Result<bool> {
        let lease = self.lease()?;
        let r = match self.client.create(key, value, lease) {
            Err(e) if lease_gone(&e) => {
                let id = self.grant()?;
                *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
                self.client.create(key, value, id)
            }
            r => r,
        };
        Ok(match r? {
            Created::Won(_) => true,
            Created::Lost(kv) => kv.is_some_and(|kv| kv.value == value),
        })
    }

    fn keepalive(&self) -> Result<bool> {
        let Some(id) = *self.lease.lock().unwrap_or_else(|e| e.into_inner()) else {
            return Ok(false);
        };
        if self.client.lease_keepalive(id)?.is_some() {
            return Ok(false);
        }
        tracing::info!(
            "etcd lease {id:x} is gone ({}); granting a new one",
            self.client.location()
        );
        let new = self.grant()?;
        *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(new);
        Ok(true)
    }

    fn close(&self) {
        if let Some(id) = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if let Err(e) = self.client.lease_revoke(id) {
                tracing::debug!("{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn endpoints_in_mooncakes_forms() {
        let want = vec!["h1:2379".to_string(), "h2:2380".to_string()];
        assert_eq!(super::parse_endpoints("etcd://h1:2379;h2:2380"), want);
        assert_eq!(super::parse_endpoints(" h1:2379, http://h2:2380/ ;"), want);
        assert!(super::parse_endpoints("etcd://").is_empty());
    }
}
