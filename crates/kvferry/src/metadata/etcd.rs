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

use super::{Backend, MetadataStore, StoreOptions};
use crate::error::{Error, Result};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Largest answer accepted (a descriptor of ~100k buffers, base64-encoded).
const MAX_ANSWER: u64 = 192 << 20;

pub struct EtcdStore {
    location: String,
    endpoints: Vec<String>,
    agent: ureq::Agent,
    /// The endpoint that answered last (tried first).
    current: AtomicUsize,
    ttl: i64,
    lease: Mutex<Option<i64>>,
}

/// An int64 of the gateway's JSON (proto3 maps int64 to a string; accept a number too).
fn int(v: &Value) -> Option<i64> {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_i64())
}

impl EtcdStore {
    pub fn connect(endpoints: &[String], opts: &StoreOptions) -> Result<EtcdStore> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(opts.timeout))
            .timeout_connect(Some(opts.connect_timeout()))
            .max_idle_connections_per_host(4)
            .user_agent("kvferry")
            .build();
        let store = EtcdStore {
            location: format!("etcd://{}", endpoints.join(",")),
            endpoints: endpoints.to_vec(),
            agent: ureq::Agent::new_with_config(config),
            current: AtomicUsize::new(0),
            ttl: opts.lease_ttl.as_secs().max(2) as i64,
            lease: Mutex::new(None),
        };
        // Fail now, with the reason, if no endpoint answers.
        store.call("connecting", "/v3/maintenance/status", json!({}))?;
        Ok(store)
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata { backend: Backend::Etcd.name(), location: self.location.clone(), reason }
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
            let Some(ep) = self.endpoints.get(i) else { break };
            let resp = self.agent.post(&format!("http://{ep}{path}")).header("content-type", "application/json").send(bytes.as_bytes());
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
            resp.into_body().into_reader().take(MAX_ANSWER + 1).read_to_end(&mut buf).map_err(|e| self.err(format!("{what}: reading the answer: {e}")))?;
            // A streaming call (lease keepalive) answers one JSON object per line.
            let first_line = buf.split(|&b| b == b'\n').next().unwrap_or(&[]);
            let v: Value = serde_json::from_slice(first_line).map_err(|e| self.err(format!("{what}: the answer is not JSON ({e}): is {ep} an etcd (3.4 or newer) client port?")))?;
            if status != 200 || v.get("error").is_some() {
                let msg = v.get("message").or_else(|| v.get("error")).and_then(Value::as_str).unwrap_or("unknown error");
                return Err(self.err(format!("{what}: {msg} (HTTP {status})")));
            }
            return Ok(v);
        }
        Err(self.err(format!("{what}: no endpoint answered ({last}); is etcd running and reachable at this address?")))
    }

    fn grant(&self) -> Result<i64> {
        let v = self.call("granting a lease", "/v3/lease/grant", json!({ "TTL": self.ttl }))?;
        v.get("ID").and_then(int).ok_or_else(|| self.err(format!("granting a lease: no ID in the answer {v}")))
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

    fn put_under(&self, key: &str, value: &[u8], lease: i64) -> Result<()> {
        let body = json!({ "key": B64.encode(key), "value": B64.encode(value), "lease": lease.to_string() });
        self.call(&format!("PUT {key}"), "/v3/kv/put", body).map(drop)
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
        &self.location
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let v = self.call(&format!("GET {key}"), "/v3/kv/range", json!({ "key": B64.encode(key) }))?;
        let Some(kv) = v.get("kvs").and_then(Value::as_array).and_then(|a| a.first()) else { return Ok(None) };
        // An empty value is omitted from the JSON.
        let value = kv.get("value").and_then(Value::as_str).unwrap_or("");
        B64.decode(value).map(Some).map_err(|e| self.err(format!("GET {key}: the value is not base64 ({e})")))
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let lease = self.lease()?;
        match self.put_under(key, value, lease) {
            Err(e) if lease_gone(&e) => {
                // The lease vanished (etcd lost its data, or it expired): take a new one.
                let id = self.grant()?;
                *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
                self.put_under(key, value, id)
            }
            r => r,
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.call(&format!("DELETE {key}"), "/v3/kv/deleterange", json!({ "key": B64.encode(key) })).map(drop)
    }

    fn keepalive(&self) -> Result<bool> {
        let Some(id) = *self.lease.lock().unwrap_or_else(|e| e.into_inner()) else { return Ok(false) };
        let ttl = match self.call("renewing the lease", "/v3/lease/keepalive", json!({ "ID": id.to_string() })) {
            // {"result": {"ID": ..., "TTL": ...}}; an expired lease comes back without a TTL.
            Ok(v) => v.get("result").unwrap_or(&v).get("TTL").and_then(int).unwrap_or(0),
            Err(e) if lease_gone(&e) => 0,
            Err(e) => return Err(e),
        };
        if ttl > 0 {
            return Ok(false);
        }
        tracing::info!("etcd lease {id:x} is gone ({}); granting a new one", self.location);
        let new = self.grant()?;
        *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(new);
        Ok(true)
    }

    fn close(&self) {
        if let Some(id) = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if let Err(e) = self.call("revoking the lease", "/v3/lease/revoke", json!({ "ID": id.to_string() })) {
                tracing::debug!("{e}");
            }
        }
    }
}
