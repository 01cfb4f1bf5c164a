//! etcd v3 backend (`etcd-client`, async) behind a blocking API: a private tokio runtime with
//! one worker thread runs every call, each bounded by the configured timeout.
//!
//! Entries are put under one lease per store (TTL `KVFERRY_METADATA_LEASE_TTL`). The engine's
//! keeper calls [`MetadataStore::keepalive`] every third of the TTL; when etcd no longer knows
//! the lease (it expired while the engine was cut off, or etcd lost its data) a new one is
//! granted and the keeper re-publishes. A crashed engine stops renewing, so its entries vanish
//! by themselves after the TTL. [`MetadataStore::close`] revokes the lease.

use super::{Backend, MetadataStore, StoreOptions};
use crate::error::{Error, Result};
use etcd_client::{Client, ConnectOptions, PutOptions};
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

pub struct EtcdStore {
    location: String,
    rt: tokio::runtime::Runtime,
    client: Client,
    timeout: Duration,
    ttl: i64,
    lease: Mutex<Option<i64>>,
}

impl EtcdStore {
    pub fn connect(endpoints: &[String], opts: &StoreOptions) -> Result<EtcdStore> {
        let location = format!("etcd://{}", endpoints.join(","));
        let err = |reason: String| Error::Metadata { backend: Backend::Etcd.name(), location: location.clone(), reason };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvf-etcd")
            .enable_all()
            .build()
            .map_err(|e| err(format!("cannot start the etcd client runtime: {e}")))?;
        let urls: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
        let copts = ConnectOptions::new()
            .with_connect_timeout(opts.connect_timeout())
            .with_timeout(opts.timeout)
            .with_keep_alive(Duration::from_secs(10), opts.timeout);
        let client = rt
            .block_on(async { tokio::time::timeout(opts.timeout, Client::connect(urls, Some(copts))).await })
            .map_err(|_| err("connecting timed out".into()))?
            .map_err(|e| err(format!("cannot connect: {e}")))?;
        let ttl = opts.lease_ttl.as_secs().max(2) as i64;
        Ok(EtcdStore { location, rt, client, timeout: opts.timeout, ttl, lease: Mutex::new(None) })
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata { backend: Backend::Etcd.name(), location: self.location.clone(), reason }
    }

    /// Runs one etcd call with the timeout; the error says what was attempted.
    fn run<T, F>(&self, what: &str, f: impl FnOnce(Client) -> F) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let client = self.client.clone();
        match self.rt.block_on(async { tokio::time::timeout(self.timeout, f(client)).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.err(format!("{what}: {e} (is etcd running and reachable at this address?)"))),
            Err(_) => Err(self.err(format!("{what}: no answer within {:?} (is etcd running and reachable at this address?)", self.timeout))),
        }
    }

    fn grant(&self) -> Result<i64> {
        let ttl = self.ttl;
        let r = self.run("granting a lease", |mut c| async move { c.lease_grant(ttl, None).await })?;
        Ok(r.id())
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

impl MetadataStore for EtcdStore {
    fn backend(&self) -> Backend {
        Backend::Etcd
    }

    fn location(&self) -> &str {
        &self.location
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let k = key.to_string();
        let r = self.run(&format!("GET {key}"), |mut c| async move { c.get(k, None).await })?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let lease = self.lease()?;
        let (k, v) = (key.to_string(), value.to_vec());
        let r = self.run(&format!("PUT {key}"), |mut c| async move { c.put(k, v, Some(PutOptions::new().with_lease(lease))).await });
        match r {
            Err(Error::Metadata { reason, .. }) if reason.contains("lease not found") => {
                // The lease vanished (etcd lost its data, or it expired): take a new one.
                let id = self.grant()?;
                *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
                let (k, v) = (key.to_string(), value.to_vec());
                self.run(&format!("PUT {key}"), |mut c| async move { c.put(k, v, Some(PutOptions::new().with_lease(id))).await }).map(|_| ())
            }
            r => r.map(|_| ()),
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        let k = key.to_string();
        self.run(&format!("DELETE {key}"), |mut c| async move { c.delete(k, None).await }).map(|_| ())
    }

    fn keepalive(&self) -> Result<bool> {
        let Some(id) = *self.lease.lock().unwrap_or_else(|e| e.into_inner()) else { return Ok(false) };
        let ttl = match self.run("renewing the lease", |mut c| async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(id).await?;
            keeper.keep_alive().await?;
            Ok(stream.message().await?.map(|m| m.ttl()).unwrap_or(0))
        }) {
            Ok(ttl) => ttl,
            // etcd forgot the lease (expired, or etcd lost its data): the same as TTL 0.
            Err(Error::Metadata { reason, .. }) if reason.contains("lease not found") => 0,
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
            if let Err(e) = self.run("revoking the lease", |mut c| async move { c.lease_revoke(id).await }) {
                tracing::debug!("{e}");
            }
        }
    }
}
