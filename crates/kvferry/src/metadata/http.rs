//! Mooncake's HTTP metadata contract (reference §2.7): `GET/PUT/DELETE <url>?key=<key>`,
//! only 200 is success, 404 on GET means absent. Works against `kvferry metadata-server`,
//! `mooncake_http_metadata_server` and `mooncake_master`'s embedded server.
//!
//! Blocking client (ureq) with keep-alive connections; every request is bounded by the
//! configured timeout (connect by at most 1.5 s, as Mooncake's libcurl plugin).
//!
//! `https://` URLs use rustls (no OpenSSL): the server's certificate is verified against the
//! built-in Mozilla roots, or against the CA certificates of the PEM file given as
//! `KVFERRY_METADATA_CA_FILE` (like curl's `--cacert`: those replace the built-in roots).
//!
//! With the cluster key (`KVFERRY_AUTH_KEY_FILE`, [`StoreOptions::auth_key_file`]) every
//! request, read or write, carries an `X-Kvferry-Auth` header signing it
//! ([`crate::auth_http`]): a `kvferry metadata-server` holding the key takes writes only so
//! signed (its reads are open, and Mooncake's servers ignore the header). A refusal's answer
//! (401) says why, and is in the error.
//!
//! With a shared token (`MC_METADATA_HTTP_TOKEN` / `KVFERRY_METADATA_HTTP_TOKEN`,
//! [`StoreOptions::http_token`]) every request carries `Authorization: Bearer <token>`, as
//! Mooncake 0.3.14's engines send it; servers holding a token (its Python
//! `mooncake_http_metadata_server`, `kvferry metadata-server`, `kvferry master`'s embedded one)
//! answer 401 without it.

use super::{url_encode, Backend, MetadataStore, Seen, StoreOptions};
use crate::error::{Error, Result};
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

/// Largest value accepted from the server (a descriptor of ~100k buffers).
const MAX_VALUE: u64 = 128 << 20;

const TLS_HINT: &str = " (TLS: the server's certificate must be issued for this host name by a CA in KVFERRY_METADATA_CA_FILE, or by a public CA when that is unset; is it an https server?)";

pub(crate) struct HttpStore {
    url: String,
    agent: ureq::Agent,
    /// Signs every request when the cluster key is configured.
    key: Option<crate::auth::ClusterKey>,
    /// `Bearer <token>`, sent as `Authorization` with every request, when a token is set.
    bearer: Option<String>,
}

impl HttpStore {
    pub(crate) fn new(url: &str, opts: &StoreOptions) -> Result<HttpStore> {
        let mut roots = ureq::tls::RootCerts::WebPki;
        if let Some(file) = opts.ca_file.as_deref().filter(|_| is_https(url)) {
            roots = load_roots(file).map_err(|reason| Error::Metadata {
                backend: Backend::Http.name(),
                location: url.to_string(),
                reason,
            })?;
        }
        let key = crate::auth::ClusterKey::from_config(opts.auth_key_file.as_deref())
            .map_err(|e| Error::Config(e.to_string()))?;
        let config = ureq::Agent::config_builder()
            .tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build())
            .http_status_as_error(false)
            .timeout_global(Some(opts.timeout))
            .timeout_connect(Some(opts.connect_timeout()))
            .max_idle_connections_per_host(16)
            .user_agent("kvferry")
            .build();
        let agent = ureq::Agent::with_parts(
            config,
            DefaultConnector::default(),
            CachingResolver::default(),
        );
        Ok(HttpStore {
            url: url.to_string(),
            agent,
            key,
            bearer: opts.http_token.as_ref().map(|t| format!("Bearer {t}")),
        })
    }

    fn err(&self, reason: String) -> Error {
        Error::Metadata {
            backend: Backend::Http.name(),
            location: self.url.clone(),
            reason,
        }
    }

    fn target(&self, key: &str) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}key={}", self.url, url_encode(key))
    }

    /// `req` with the shared token's `Authorization` header, when a token is set.
    fn with_token<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.bearer {
            Some(b) => req.header("Authorization", b.as_str()),
            None => req,
        }
    }

    /// The `X-Kvferry-Auth` value for `method` on `target` with `body`, when a key is held.
    fn auth(&self, method: &str, target: &str, body: &[u8]) -> Option<String> {
        let key = self.key.as_ref()?;
        // What ureq sends on the request line: the URI's path and query, `/` without one.
        let uri = target.parse::<ureq::http::Uri>().ok();
        let pq = uri
            .as_ref()
            .and_then(|u| u.path_and_query())
            .map_or("/", |p| p.as_str());
        Some(crate::auth_http::sign_now(key, method, pq, body))
    }

    fn transport_err(&self, what: &str, key: &str, e: ureq::Error) -> Error {
        let hint = match &e {
            ureq::Error::Timeout(_) => {
                " (timed out: is the metadata server up and reachable from here?)"
            }
            ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
                " (connection refused: is the metadata server running at this address?)"
            }
            ureq::Error::Rustls(_) | ureq::Error::Tls(_) | ureq::Error::Pem(_) => TLS_HINT,
            ureq::Error::Io(io)
                if is_https(&self.url) && io.kind() == std::io::ErrorKind::InvalidData =>
            {
                TLS_HINT
            }
            _ => " (is the metadata server running at this address?)",
        };
        self.err(format!("{what} {key}: {e}{hint}"))
    }

    /// A PUT's status and answer.
    fn put_answer(&self, key: &str, value: &[u8]) -> Result<(u16, Vec<u8>)> {
        let target = self.target(key);
        let mut req = self.with_token(
            self.agent
                .put(&target)
                .header("Content-Type", "application/json"),
        );
        if let Some(auth) = self.auth("PUT", &target, value) {
            req = req.header(crate::auth_http::HEADER, auth);
        }
        let resp = req
            .send(value)
            .map_err(|e| self.transport_err("PUT", key, e))?;
        self.body(key, resp)
    }

    /// Reads the body of a response, bounded.
    fn body(&self, key: &str, resp: ureq::http::Response<ureq::Body>) -> Result<(u16, Vec<u8>)> {
        let status = resp.status().as_u16();
        let mut buf = Vec::new();
        resp.into_body()
            .into_reader()
            .take(MAX_VALUE + 1)
            .read_to_end(&mut buf)
            .map_err(|e| self.err(format!("reading the answer for {key}: {e}")))?;
        if buf.len() as u64 > MAX_VALUE {
            return Err(self.err(format!(
                "the value of {key} is larger than {MAX_VALUE} bytes"
            )));
        }
        Ok((status, buf))
    }

    fn refusal(&self, what: &str, key: &str, status: u16, body: &[u8]) -> Error {
        // (Long enough for a refusal's cause and fix.)
        let text = String::from_utf8_lossy(&body[..body.len().min(600)])
            .trim()
            .to_string();
        // A token server's refusal ("unauthorized"; kvferry's cluster-key refusals say why).
        let hint = if status == 401 && !text.contains(crate::auth_http::HEADER) {
            match self.bearer {
                None => " (the metadata server requires a token: set MC_METADATA_HTTP_TOKEN, or KVFERRY_METADATA_HTTP_TOKEN, to the server's)",
                Some(_) => " (the metadata server refused this engine's token: MC_METADATA_HTTP_TOKEN, or KVFERRY_METADATA_HTTP_TOKEN, must be the server's)",
            }
        } else {
            ""
        };
        self.err(format!(
            "{what} {key} answered HTTP {status} {text:?}{hint}"
        ))
    }
}

/// How long a resolved host name is reused (libcurl's default DNS cache timeout).
const DNS_TTL: Duration = Duration::from_secs(60);

/// ureq resolves the host before every request, even one that then reuses a pooled
/// connection, and with a timeout configured it does so in a new thread: a thread spawn and a
/// `getaddrinfo` per GET (a tail of milliseconds on a busy host). This resolver answers an IP
/// literal at once and keeps a host name's addresses for [`DNS_TTL`]; a lookup still runs in
/// ureq's bounded resolver.
#[derive(Debug, Default)]
struct CachingResolver {
    inner: DefaultResolver,
    cache: Mutex<Option<(String, Instant, ResolvedSocketAddrs)>>,
}

impl Resolver for CachingResolver {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> std::result::Result<ResolvedSocketAddrs, ureq::Error> {
        let port = uri.port_u16().unwrap_or(
            if uri
                .scheme_str()
                .is_some_and(|s| s.eq_ignore_ascii_case("https"))
            {
                443
            } else {
                80
            },
        );
        let host = uri.host().unwrap_or_default();
        if let Ok(ip) = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            let mut addrs = self.empty();
            addrs.push(SocketAddr::new(ip, port));
            return Ok(addrs);
        }
        let key = format!("{host}:{port}");
        if let Some((k, at, addrs)) = &*self.cache.lock().unwrap_or_else(|e| e.into_inner()) {
            if *k == key && at.elapsed() < DNS_TTL {
                return Ok(addrs.clone());
            }
        }
        let addrs = self.inner.resolve(uri, config, timeout)?;
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((key, Instant::now(), addrs.clone()));
        Ok(addrs)
    }
}

/// The write an `ETag` names: `kvferry metadata-server` sends a number in quotes; anything
/// else (a weak validator, another server's tag) names none.
fn parse_etag(tag: &str) -> Option<i64> {
    tag.trim()
        .strip_prefix('"')?
        .strip_suffix('"')?
        .parse()
        .ok()
}

fn is_https(url: &str) -> bool {
    url.get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

/// The CA certificates of a PEM file; an error names the file and what is wrong with it.
fn load_roots(file: &Path) -> std::result::Result<ureq::tls::RootCerts, String> {
    let what = format!("KVFERRY_METADATA_CA_FILE={}", file.display());
    let pem = std::fs::read(file).map_err(|e| format!("{what}: cannot read it: {e}"))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
            Ok(_) => {}
            Err(e) => return Err(format!("{what}: not a valid PEM file: {e}")),
        }
    }
    if certs.is_empty() {
        return Err(format!(
            "{what}: holds no PEM certificate (\"-----BEGIN CERTIFICATE-----\")"
        ));
    }
    Ok(ureq::tls::RootCerts::new_with_certs(&certs))
}

impl MetadataStore for HttpStore {
    fn backend(&self) -> Backend {
        Backend::Http
    }

    fn location(&self) -> &str {
        &self.url
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.get_seen(key)?.map(|s| s.value))
    }

    /// A GET; `kvferry metadata-server` names the write in an `ETag` (a number in quotes),
    /// Mooncake's servers send none (then no revision: [`MetadataStore::remove_if`] compares
    /// the value, not atomically).
    fn get_seen(&self, key: &str) -> Result<Option<Seen>> {
        let target = self.target(key);
        let mut req = self.with_token(self.agent.get(&target));
        if let Some(auth) = self.auth("GET", &target, b"") {
            req = req.header(crate::auth_http::HEADER, auth);
        }
        let resp = req.call().map_err(|e| self.transport_err("GET", key, e))?;
        let revision = resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_etag);
        match self.body(key, resp)? {
            (200, value) => Ok(Some(Seen { value, revision })),
            (404, _) => Ok(None),
            (s, b) => Err(self.refusal("GET", key, s, &b)),
        }
    }

    /// With a revision (`kvferry metadata-server`): one `DELETE` with `If-Match`, which the
    /// server refuses (412) when the key was written since, an identical value too. Without
    /// one (Mooncake's servers): a look, a compare and a delete, which engines replacing one
    /// dead entry at the same instant can interleave.
    fn remove_if(&self, key: &str, seen: &Seen) -> Result<bool> {
        let Some(rev) = seen.revision else {
            return super::remove_by_look(self, key, seen);
        };
        let target = self.target(key);
        let mut req = self.with_token(
            self.agent
                .delete(&target)
                .header("If-Match", format!("\"{rev}\"")),
        );
        if let Some(auth) = self.auth("DELETE", &target, b"") {
            req = req.header(crate::auth_http::HEADER, auth);
        }
        let resp = req
            .call()
            .map_err(|e| self.transport_err("DELETE", key, e))?;
        match self.body(key, resp)? {
            (200, _) => Ok(true),
            (404 | 412, _) => Ok(false),
            (s, b) => Err(self.refusal("DELETE (if unchanged)", key, s, &b)),
        }
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.put_answer(key, value)? {
            (200, _) => Ok(()),
            (s, b) => Err(self.refusal("PUT", key, s, &b)),
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        let target = self.target(key);
        let mut req = self.with_token(self.agent.delete(&target));
        if let Some(auth) = self.auth("DELETE", &target, b"") {
            req = req.header(crate::auth_http::HEADER, auth);
        }
        let resp = req
            .call()
            .map_err(|e| self.transport_err("DELETE", key, e))?;
        match self.body(key, resp)? {
            (200 | 404, _) => Ok(()),
            (s, b) => Err(self.refusal("DELETE", key, s, &b)),
        }
    }

    /// Mooncake's HTTP servers (and kvferry's) keep an `rpc_meta` entry once made: a PUT of
    /// another value is refused (400), of the same one accepted, so for those keys the PUT
    /// itself is the atomic create (a refusal whose entry is gone by the look after it:
    /// `false`, and the caller looks again, rather than an error). Other keys are
    /// overwritten by a PUT: looked at first (nothing creates those but their owner).
    fn create(&self, key: &str, value: &[u8]) -> Result<bool> {
        if !super::is_rpc_meta(key) {
            return super::create_by_look(self, key, value);
        }
        match self.put_answer(key, value)? {
            (200, _) => Ok(true),
            // Another value is there (or was: removed since, the next look finds it gone).
            (400, _) => Ok(self.get(key)?.is_some_and(|v| v == value)),
            (s, b) => Err(self.refusal("PUT", key, s, &b)),
        }
    }
}
