//! `kvferry metadata-server`: Mooncake's HTTP metadata contract (reference §2.7), as the C++
//! server embedded in `mooncake_master` answers it, plus optional durability.
//!
//! - `GET /metadata?key=K` → 200 + the stored bytes, 404 `metadata not found`.
//! - `PUT /metadata?key=K` (body = value) → 200 `metadata updated`; a PUT to an existing key
//!   containing `rpc_meta` → 200 `metadata unchanged` with an identical body, 400
//!   `Duplicate rpc_meta key not allowed` with a different one.
//! - `DELETE /metadata?key=K` → 200 `metadata deleted`, 404 `metadata not found`.
//! - kvferry's addition, which Mooncake's clients and servers ignore: a GET's answer carries an
//!   `ETag` naming the write that left the value (a number that grows with every PUT, an
//!   identical one too, from a random start, so a restarted server does not reuse one), and a
//!   DELETE with `If-Match` removes the value only if that write is still the one there (412
//!   `metadata changed since the write If-Match names; ...` otherwise). What an engine
//!   replacing a dead engine's `rpc_meta` entry needs so that it never removes the entry
//!   another engine just made (`MetadataStore::remove_if`).
//! - No or empty key → 400 `metadata key is required`; other methods → 405; `GET /health` → `OK`.
//! - `--max-keys` / `--max-total-bytes` (Mooncake 0.3.14's `MC_METADATA_MAX_KEYS` /
//!   `MC_METADATA_MAX_TOTAL_BYTES`; 0, the default: no limit): a PUT of a new key past the first,
//!   or one that would hold more key and value bytes than the second, → 507 `metadata key
//!   budget exhausted` / `metadata size budget exhausted`, and nothing changes.
//! - With the cluster key (`KVFERRY_AUTH_KEY_FILE`, read from kvferry's `Config`; `kvferry
//!   master --enable-http-metadata-server` passes the one it read): every request to
//!   `/metadata` other than GET and HEAD (PUT, DELETE, POST...) must carry an
//!   `X-Kvferry-Auth` header signing it (`kvferry::auth_http`: within 30 s of this server's
//!   clock, each nonce taken once); without a valid one it gets 401 and a body naming the
//!   cause and the fix, and changes nothing. kvferry's HTTP metadata client signs its requests
//!   when it holds the key. Stock Mooncake HTTP clients cannot prove the key, so a keyed server
//!   refuses their writes (their engines cannot register with it); reads (GET) and `/health`
//!   stay open to every client, as Mooncake's clients need them.
//! - With a shared token (`MC_METADATA_HTTP_TOKEN` / `KVFERRY_METADATA_HTTP_TOKEN`, read from
//!   kvferry's `Config`; the master passes the one it read), as Mooncake 0.3.14's Python
//!   `mooncake_http_metadata_server`: every request to `/metadata`, whatever its method, must
//!   carry `Authorization: Bearer <token>` (the scheme in any case; compared in constant
//!   time); without it, or with another token, it gets 401 `unauthorized` before anything
//!   else is looked at (its key too). `/health` stays open. Engines of both (kvferry's HTTP
//!   metadata client, Mooncake 0.3.14's) send the header when the variable is set.
//!
//! With `--data-dir` every change is appended to `metadata.log` and fsync'ed before the reply,
//! so a restarted server answers with what it had (a torn last record is dropped; the log is
//! compacted at start). Bodies are bounded (`--max-body-bytes`, 413 beyond), slow clients are
//! cut off (`--request-timeout` for headers and body), malformed requests get 400 from hyper
//! and only cost their own connection; connections are capped (`--max-connections`).

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Keep the metadata in this directory (fsync'ed before each reply) so that a restarted
    /// server still has it. Without it the server keeps everything in memory, as Mooncake's.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Largest request body accepted (bytes); larger PUTs get 413.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_body_bytes: u64,
    /// Most keys held (0: no limit); a PUT of a new key past it gets 507 `metadata key
    /// budget exhausted`, as Mooncake 0.3.14's `MC_METADATA_MAX_KEYS`.
    #[arg(long, default_value_t = 0)]
    pub max_keys: u64,
    /// Most bytes held, keys and values together (0: no limit); a PUT past it gets 507
    /// `metadata size budget exhausted`, as Mooncake 0.3.14's `MC_METADATA_MAX_TOTAL_BYTES`.
    #[arg(long, default_value_t = 0)]
    pub max_total_bytes: u64,
    /// Seconds a client may take to send a request's headers, and again its body.
    #[arg(long, default_value_t = 10.0)]
    pub request_timeout: f64,
    /// Most connections served at once; more are closed at accept (1 to 1048576).
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Threads serving connections, each with its own single-threaded runtime; connections
    /// are dealt to them round robin (0: one per CPU; at most 1024).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The cluster key writes must be signed with (not a flag: [`run`] reads
    /// `KVFERRY_AUTH_KEY_FILE` through kvferry's `Config`, the master passes the key it read).
    #[arg(skip)]
    pub auth: Option<kvferry::auth::ClusterKey>,
    /// The shared token every `/metadata` request must carry (not a flag: [`run`] reads
    /// `MC_METADATA_HTTP_TOKEN` / `KVFERRY_METADATA_HTTP_TOKEN` through kvferry's `Config`,
    /// the master passes the one it read).
    #[arg(skip)]
    pub token: Option<String>,
}

const OP_PUT: u8 = 1;
const OP_DELETE: u8 = 2;
const LOG_NAME: &str = "metadata.log";
/// How much a log may grow beyond twice its compacted length before it is compacted again.
const COMPACT_FLOOR: u64 = 8 << 20;

/// The append-only log of a durable server.
struct Wal {
    file: File,
    path: PathBuf,
    dir: PathBuf,
    /// The log's length after it was last compacted: it is compacted again once it grew
    /// past twice that plus [`COMPACT_FLOOR`], so it stays within about twice the live
    /// entries (every engine's descriptor is put again at each (un)registration) and each
    /// compaction is paid for by as many bytes appended.
    compacted: u64,
    /// Bytes of whole records in the file: a failed append is cut back to this, so that the
    /// records after it are not hidden behind a torn one (replay stops at the first).
    len: u64,
    /// Set when a failed append could not be cut back: every later change is refused
    /// rather than written after a torn record, where a restart would not find it.
    broken: Option<String>,
}

fn record(op: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(9 + key.len() + value.len() + 8);
    r.push(op);
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(&(value.len() as u32).to_le_bytes());
    r.extend_from_slice(key);
    r.extend_from_slice(value);
    let sum = xxhash_rust::xxh3::xxh3_64(&r);
    r.extend_from_slice(&sum.to_le_bytes());
    r
}

/// Replays a log; returns the map and the length of its valid prefix.
fn replay(bytes: &[u8]) -> (HashMap<String, Bytes>, usize) {
    let mut map = HashMap::new();
    let mut off = 0;
    loop {
        let rest = &bytes[off..];
        if rest.len() < 9 {
            break;
        }
        let klen = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let vlen = u32::from_le_bytes([rest[5], rest[6], rest[7], rest[8]]) as usize;
        let body = 9usize.saturating_add(klen).saturating_add(vlen);
        if rest.len() < body.saturating_add(8) {
            break;
        }
        let sum = u64::from_le_bytes(rest[body..body + 8].try_into().unwrap_or([0; 8]));
        if xxhash_rust::xxh3::xxh3_64(&rest[..body]) != sum {
            break;
        }
        let Ok(key) = std::str::from_utf8(&rest[9..9 + klen]) else {
            break;
        };
        match rest[0] {
            OP_PUT => {
                map.insert(
                    key.to_string(),
                    Bytes::copy_from_slice(&rest[9 + klen..body]),
                );
            }
            OP_DELETE => {
                map.remove(key);
            }
            _ => break,
        }
        off += body + 8;
    }
    (map, off)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Wal {
    /// Opens (creating) the log in `dir`, replays it, and compacts it to one record per key.
    fn open(dir: &Path) -> Result<(Wal, HashMap<String, Bytes>), String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create --data-dir {}: {e}", dir.display()))?;
        let path = dir.join(LOG_NAME);
        let mut bytes = Vec::new();
        match File::open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
        }
        let (map, valid) = replay(&bytes);
        if valid < bytes.len() {
            eprintln!(
                "kvferry metadata-server: {}: dropped {} bytes of a torn or corrupt tail",
                path.display(),
                bytes.len() - valid
            );
        }
        let (file, len) = Wal::rewrite(dir, &path, &map)?;
        Ok((
            Wal {
                file,
                path,
                dir: dir.to_path_buf(),
                compacted: len,
                len,
                broken: None,
            },
            map,
        ))
    }

    /// Compacts: writes `map`'s entries to a new file, fsyncs it, renames it over the log
    /// and syncs the directory; the log opened for appending, and its length.
    fn rewrite<'a>(
        dir: &Path,
        path: &Path,
        map: impl IntoIterator<Item = (&'a String, &'a Bytes)>,
    ) -> Result<(File, u64), String> {
        let tmp = dir.join(format!("{LOG_NAME}.tmp"));
        let io = |e: std::io::Error| {
            format!(
                "cannot write {}: {e} (check --data-dir permissions and free space)",
                tmp.display()
            )
        };
        let len = {
            let mut f = File::create(&tmp).map_err(io)?;
            let mut buf = Vec::new();
            for (k, v) in map {
                buf.extend_from_slice(&record(OP_PUT, k.as_bytes(), v));
            }
            f.write_all(&buf).map_err(io)?;
            f.sync_all().map_err(io)?;
            buf.len() as u64
        };
        std::fs::rename(&tmp, path)
            .map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
        sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        Ok((file, len))
    }

    /// Compacts the log to `map` (the state after every change it holds) once it grew past
    /// twice its last compacted length plus [`COMPACT_FLOOR`]. A failed compaction leaves
    /// the log as it was (the rename is atomic) and is tried again at the next change.
    fn maybe_compact<'a>(&mut self, map: impl IntoIterator<Item = (&'a String, &'a Bytes)>) {
        if self.broken.is_some()
            || self.len
                <= self
                    .compacted
                    .saturating_mul(2)
                    .saturating_add(COMPACT_FLOOR)
        {
            return;
        }
        match Wal::rewrite(&self.dir, &self.path, map) {
            Ok((file, len)) => {
                (self.file, self.len, self.compacted) = (file, len, len);
            }
            Err(e) => tracing::warn!("metadata-server: compacting the log: {e}"),
        }
    }

    fn append(&mut self, rec: &[u8]) -> std::io::Result<()> {
        self.append_with(rec, |f, r| f.write_all(r))
    }

    /// Appends `rec` with `write` and syncs it. On failure nothing of it stays: the file is
    /// cut back to its whole records (a partial write, or one whose sync failed and was
    /// answered as failed, must not be replayed, nor hide what is appended after it).
    fn append_with(
        &mut self,
        rec: &[u8],
        write: impl FnOnce(&mut File, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if let Some(why) = &self.broken {
            return Err(std::io::Error::other(format!(
                "the log refuses changes since an earlier write failed and could not be undone \
                ({why}); restart the server once the disk is writable"
            )));
        }
        let r = write(&mut self.file, rec).and_then(|_| self.file.sync_data());
        match r {
            Ok(()) => {
                self.len += rec.len() as u64;
                Ok(())
            }
            Err(e) => {
                if let Err(cut) = self
                    .file
                    .set_len(self.len)
                    .and_then(|_| self.file.sync_data())
                {
                    self.broken = Some(format!("{e}, then cutting it back: {cut}"));
                }
                Err(e)
            }
        }
    }
}

/// A value with the write that left it (what a GET's `ETag` names).
struct Stored {
    value: Bytes,
    rev: u64,
}

struct State {
    map: RwLock<HashMap<String, Stored>>,
    /// The next write's number. It starts at a random point of 2^62 (not at the clock,
    /// which a restart may find stepped back), so a restarted server's writes do not reuse
    /// a number an earlier run gave (an `If-Match` seen before the restart matches nothing
    /// after it) unless its start falls within as many numbers of the earlier one's as that
    /// run wrote: about one chance in 2^62 / writes.
    next_rev: std::sync::atomic::AtomicU64,
    /// Serialises changes; holds the log of a durable server.
    writer: Mutex<Option<Wal>>,
    /// A log is kept (`writer` holds one): changes wait for its fsync off the event loop.
    /// (Not read through `writer`'s lock, which a change holds across its fsync.)
    durable: bool,
    max_body: u64,
    /// `--max-keys` and `--max-total-bytes` (0: no limit).
    max_keys: u64,
    max_total: u64,
    /// Bytes held, keys and values (what `--max-total-bytes` bounds); changed under `writer`.
    total: std::sync::atomic::AtomicU64,
    body_timeout: Duration,
    /// With the cluster key: what checks the writes' signatures.
    guard: Option<kvferry::auth_http::Guard>,
    /// With a shared token: what every `/metadata` request must present.
    token: Option<String>,
}

/// Whether `header` (an `Authorization` value) presents `token` as Mooncake 0.3.14's server
/// reads it: the scheme `Bearer` in any case, one space, then the token, compared in
/// constant time.
fn bearer_ok(header: Option<&hyper::header::HeaderValue>, token: &str) -> bool {
    let Some(v) = header.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let (scheme, presented) = v.split_once(' ').unwrap_or((v, ""));
    scheme.eq_ignore_ascii_case("bearer")
        && !presented.is_empty()
        && presented.len() == token.len()
        && presented
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The answer to a write whose signature is refused (401, or 503 while the replay cache is
/// full).
fn refused(why: &kvferry::auth_http::Refusal) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(why.status()).unwrap_or(StatusCode::UNAUTHORIZED);
    let mut r = reply(status, format!("metadata write refused: {why}"));
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static(kvferry::auth_http::HEADER),
        );
    }
    r
}

/// A write's body, bounded by `--max-body-bytes` and `--request-timeout`; the answer to
/// send instead when it cannot be had.
async fn read_body(
    st: &State,
    headers: &hyper::HeaderMap,
    body: Incoming,
) -> Result<Bytes, Response<Full<Bytes>>> {
    let too_big = || {
        reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "metadata value too large: the limit is {} bytes (--max-body-bytes)",
                st.max_body
            ),
        )
    };
    let declared = headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > st.max_body) {
        return Err(too_big());
    }
    let limit = usize::try_from(st.max_body).unwrap_or(usize::MAX);
    match tokio::time::timeout(st.body_timeout, Limited::new(body, limit).collect()).await {
        Err(_) => Err(reply(
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time",
        )),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_big())
        }
        Ok(Err(e)) => Err(reply(
            StatusCode::BAD_REQUEST,
            format!("bad request body: {e}"),
        )),
        Ok(Ok(b)) => Ok(b.to_bytes()),
    }
}

/// Decodes `%XX` and `+` of a query component; `None` for invalid UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The `key` query parameter, decoded and trimmed (as Mooncake's servers do).
fn query_key(query: Option<&str>) -> Option<String> {
    let q = query?;
    q.split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == "key")
        .and_then(|(_, v)| percent_decode(v))
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
}

/// The `ETag` of write `rev` (a strong validator, quoted as HTTP wants it).
/// What an entry counts against `--max-total-bytes`: its key's and its value's bytes (as
/// Mooncake 0.3.14's server counts them).
fn entry_bytes(key: &str, value: &[u8]) -> u64 {
    (key.len() + value.len()) as u64
}

fn etag(rev: u64) -> String {
    format!("\"{rev}\"")
}

impl State {
    fn get(&self, key: &str) -> Option<Bytes> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .map(|s| s.value.clone())
    }

    /// The value with its `ETag`.
    fn get_tagged(&self, key: &str) -> Option<(Bytes, String)> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .map(|s| (s.value.clone(), etag(s.rev)))
    }

    fn rev(&self) -> u64 {
        self.next_rev
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn compact(&self, w: &mut Option<Wal>) {
        if let Some(wal) = w.as_mut() {
            // (Readers go on meanwhile: only changes wait, on the writer's lock.)
            wal.maybe_compact(
                self.map
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(k, s)| (k, &s.value)),
            );
        }
    }

    /// A change, serialised and (when durable) logged and fsync'ed before it is applied.
    fn put(&self, key: &str, value: Bytes) -> Result<Response<Full<Bytes>>, String> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if key.contains("rpc_meta") {
            if let Some(old) = self.get(key) {
                return Ok(if old == value {
                    // Written again (the same engine registering anew): a new write, which
                    // an `If-Match` naming the old one must not remove. Nothing to log.
                    if let Some(s) = self
                        .map
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(key)
                    {
                        s.rev = self.rev();
                    }
                    reply(StatusCode::OK, "metadata unchanged")
                } else {
                    reply(
                        StatusCode::BAD_REQUEST,
                        "Duplicate rpc_meta key not allowed",
                    )
                });
            }
        }
        // Mooncake 0.3.14's budgets: a new key past --max-keys, or a total of keys and values
        // past --max-total-bytes (the old value of the key counted out), is refused.
        let (held, old) = {
            let map = self.map.read().unwrap_or_else(|e| e.into_inner());
            (
                map.len() as u64,
                map.get(key).map(|s| entry_bytes(key, &s.value)),
            )
        };
        if old.is_none() && self.max_keys > 0 && held >= self.max_keys {
            return Ok(reply(
                StatusCode::INSUFFICIENT_STORAGE,
                "metadata key budget exhausted",
            ));
        }
        let total = self.total.load(std::sync::atomic::Ordering::Relaxed);
        let new_total = total
            .saturating_sub(old.unwrap_or(0))
            .saturating_add(entry_bytes(key, &value));
        if self.max_total > 0 && new_total > self.max_total {
            return Ok(reply(
                StatusCode::INSUFFICIENT_STORAGE,
                "metadata size budget exhausted",
            ));
        }
        if let Some(wal) = w.as_mut() {
            wal.append(&record(OP_PUT, key.as_bytes(), &value))
                .map_err(|e| format!("writing {}: {e}", wal.path.display()))?;
        }
        self.total
            .store(new_total, std::sync::atomic::Ordering::Relaxed);
        let rev = self.rev();
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), Stored { value, rev });
        self.compact(&mut w);
        Ok(reply(StatusCode::OK, "metadata updated"))
    }

    /// Removes `key`; with `if_match` (an `If-Match` header) only if the write it names is
    /// still the one there.
    fn delete(&self, key: &str, if_match: Option<&str>) -> Result<Response<Full<Bytes>>, String> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let Some((_, tag)) = self.get_tagged(key) else {
            return Ok(reply(StatusCode::NOT_FOUND, "metadata not found"));
        };
        if if_match.is_some_and(|m| m.trim() != "*" && !m.split(',').any(|t| t.trim() == tag)) {
            return Ok(reply(
                StatusCode::PRECONDITION_FAILED,
                "metadata changed since the write If-Match names; GET it again for its current \
                ETag",
            ));
        }
        if let Some(wal) = w.as_mut() {
            wal.append(&record(OP_DELETE, key.as_bytes(), b""))
                .map_err(|e| format!("writing {}: {e}", wal.path.display()))?;
        }
        if let Some(old) = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
        {
            self.total.fetch_sub(
                entry_bytes(key, &old.value),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        self.compact(&mut w);
        Ok(reply(StatusCode::OK, "metadata deleted"))
    }
}

async fn handle(
    req: Request<Incoming>,
    st: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path();
    if path == "/health" {
        return Ok(match *req.method() {
            Method::GET | Method::HEAD => reply(StatusCode::OK, "OK"),
            _ => reply(StatusCode::METHOD_NOT_ALLOWED, "Method not allowed"),
        });
    }
    if path != "/metadata" {
        return Ok(reply(StatusCode::NOT_FOUND, "Not Found"));
    }
    if let Some(t) = &st.token {
        if !bearer_ok(req.headers().get(hyper::header::AUTHORIZATION), t) {
            return Ok(reply(StatusCode::UNAUTHORIZED, "unauthorized"));
        }
    }
    let method = req.method().clone();
    // With the cluster key, a write without a well-formed, fresh signature is refused before
    // its body is read; its tag and nonce are checked once the body is.
    let claim = match &st.guard {
        Some(g) if !matches!(method, Method::GET | Method::HEAD) => match g.precheck(
            req.headers()
                .get(kvferry::auth_http::HEADER)
                .map(|v| v.as_bytes()),
            kvferry::auth_http::now_ms(),
        ) {
            Ok(c) => Some((g, c)),
            Err(why) => return Ok(refused(&why)),
        },
        _ => None,
    };
    let Some(key) = query_key(req.uri().query()) else {
        return Ok(reply(StatusCode::BAD_REQUEST, "metadata key is required"));
    };
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let (parts, body) = req.into_parts();
    let body = if method == Method::PUT || claim.is_some() {
        match read_body(&st, &parts.headers, body).await {
            Ok(b) => b,
            Err(r) => return Ok(r),
        }
    } else {
        Bytes::new()
    };
    if let Some((g, c)) = claim {
        if let Err(why) = g.check(
            &c,
            method.as_str(),
            &pq,
            &body,
            kvferry::auth_http::now_ms(),
        ) {
            return Ok(refused(&why));
        }
    }
    Ok(match method {
        Method::GET => match st.get_tagged(&key) {
            Some((v, tag)) => {
                let mut r = reply(StatusCode::OK, v);
                if let Ok(h) = hyper::header::HeaderValue::from_str(&tag) {
                    r.headers_mut().insert(hyper::header::ETAG, h);
                }
                r
            }
            None => reply(StatusCode::NOT_FOUND, "metadata not found"),
        },
        Method::PUT => {
            let st2 = Arc::clone(&st);
            let r = if st.durable {
                // Durable: the fsync blocks, so off the async workers.
                tokio::task::spawn_blocking(move || st2.put(&key, body))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            } else {
                st2.put(&key, body)
            };
            r.unwrap_or_else(|e| {
                reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot store the value: {e}"),
                )
            })
        }
        Method::DELETE => {
            let st2 = Arc::clone(&st);
            // (Every If-Match line, as one list; one that is not text matches nothing.)
            let lines: Vec<String> = parts
                .headers
                .get_all(hyper::header::IF_MATCH)
                .iter()
                .map(|v| v.to_str().unwrap_or("\"\"").to_string())
                .collect();
            let if_match = (!lines.is_empty()).then(|| lines.join(","));
            let r = tokio::task::spawn_blocking(move || st2.delete(&key, if_match.as_deref()))
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
            r.unwrap_or_else(|e| {
                reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot delete the value: {e}"),
                )
            })
        }
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, "Method not allowed"),
    })
}

/// `kvferry metadata-server`: the cluster key, if any, is `KVFERRY_AUTH_KEY_FILE`'s (kvferry's
/// `Config`).
/// The most connections served at once (`--max-connections`): as many as a process may hold
/// open files by default (`nr_open`), and within what a semaphore counts.
pub const MAX_CONNECTIONS: usize = 1 << 20;
/// The most serving threads (`--threads`), each with a runtime of its own.
pub const MAX_THREADS: usize = 1024;

pub fn run(mut a: ServerArgs) -> Result<(), String> {
    let env = kvferry::Config::from_env().map_err(|e| e.to_string())?;
    a.auth = kvferry::auth::ClusterKey::from_config(env.auth_key_file.as_deref())
        .map_err(|e| e.to_string())?;
    a.token = env.metadata_http_token;
    run_inner(a, true, None)
}

/// Like [`run`], without the "listening on" line on stdout (for `kvferry master`, which
/// announces the URL itself), and with the cluster key `a.auth` as given (the master's).
/// As [`run`], quietly, on a listener the caller bound (so it may announce the address before
/// this thread starts: connections wait in the backlog until it serves).
pub fn run_quiet(a: ServerArgs, listener: std::net::TcpListener) -> Result<(), String> {
    run_inner(a, false, Some(listener))
}

fn run_inner(
    a: ServerArgs,
    announce: bool,
    bound: Option<std::net::TcpListener>,
) -> Result<(), String> {
    if a.max_body_bytes > u64::from(u32::MAX) {
        return Err(format!(
            "--max-body-bytes {} is over the largest value the log records ({} bytes)",
            a.max_body_bytes,
            u32::MAX
        ));
    }
    if !(1..=MAX_CONNECTIONS).contains(&a.max_connections) {
        return Err(format!(
            "--max-connections {}: from 1 to {MAX_CONNECTIONS}",
            a.max_connections
        ));
    }
    if a.threads > MAX_THREADS {
        return Err(format!(
            "--threads {}: at most {MAX_THREADS} (0: one per CPU)",
            a.threads
        ));
    }
    if !(a.request_timeout > 0.0 && a.request_timeout < 1e6) {
        return Err(format!(
            "--request-timeout {} must be a positive number of seconds",
            a.request_timeout
        ));
    }
    let (wal, map) = match &a.data_dir {
        Some(d) => {
            let (w, m) = Wal::open(d)?;
            (Some(w), m)
        }
        None => (None, HashMap::new()),
    };
    let entries = map.len();
    let total: u64 = map.iter().map(|(k, v)| entry_bytes(k, v)).sum();
    let first_rev = rand::random::<u64>() >> 2;
    let map = map
        .into_iter()
        .enumerate()
        .map(|(i, (k, value))| {
            (
                k,
                Stored {
                    value,
                    rev: first_rev + i as u64,
                },
            )
        })
        .collect();
    let state = Arc::new(State {
        map: RwLock::new(map),
        next_rev: std::sync::atomic::AtomicU64::new(first_rev + entries as u64),
        durable: wal.is_some(),
        writer: Mutex::new(wal),
        max_body: a.max_body_bytes,
        max_keys: a.max_keys,
        max_total: a.max_total_bytes,
        total: std::sync::atomic::AtomicU64::new(total),
        body_timeout: Duration::from_secs_f64(a.request_timeout),
        guard: a.auth.clone().map(kvferry::auth_http::Guard::new),
        token: a.token.clone(),
    });
    let threads = if a.threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    } else {
        a.threads
    };
    let host = a.host.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| format!("--host {:?} is not an IP address", a.host))?;
    let addr = SocketAddr::new(ip, a.port);
    let listener = match bound {
        Some(l) => l,
        None => std::net::TcpListener::bind(addr).map_err(|e| {
            format!(
                "cannot listen on {addr}: {e} (another server on that port? pick another with --port)"
            )
        })?,
    };
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let store = match &a.data_dir {
        Some(d) => format!("durable in {} ({entries} entries loaded)", d.display()),
        None => "in memory".to_string(),
    };
    let server = Arc::new(Server {
        state,
        slots: Arc::new(tokio::sync::Semaphore::new(a.max_connections.max(1))),
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs_f64(a.request_timeout),
    });
    // One single-threaded runtime per thread; this thread accepts and deals the connections
    // round robin. A connection stays on its thread, so serving a request never wakes another
    // thread (a multi-threaded tokio runtime here cost ~25% of the GETs/s with one request in
    // flight per connection on 2 cores: futex wake-ups between workers, see BENCHMARKS.md P4).
    let mut workers = Vec::new();
    for _ in 1..threads {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Handoff>();
        let server = Arc::clone(&server);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the server runtime: {e}"))?;
        std::thread::Builder::new()
            .name("kvf-meta-http".into())
            .spawn(move || {
                rt.block_on(async move {
                    while let Some((stream, peer, permit)) = rx.recv().await {
                        match tokio::net::TcpStream::from_std(stream) {
                            Ok(s) => serve_connection(&server, s, peer, permit),
                            Err(e) => tracing::warn!("connection from {peer}: {e}"),
                        }
                    }
                })
            })
            .map_err(|e| format!("cannot start a server thread: {e}"))?;
        workers.push(tx);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the server runtime: {e}"))?;
    announce_line(announce, local, &store);
    if a.token.is_some() {
        let line = "a token is set (MC_METADATA_HTTP_TOKEN / KVFERRY_METADATA_HTTP_TOKEN): \
                   requests to /metadata without it get 401";
        if announce {
            eprintln!("kvferry metadata-server: {line}");
        } else {
            tracing::info!("metadata server: {line}");
        }
    }
    if a.auth.is_some() {
        let line = "the cluster key (KVFERRY_AUTH_KEY_FILE) is held: writes (PUT, DELETE) need a \
                   request signed with it (kvferry's clients holding it sign theirs; stock \
                   Mooncake clients cannot), reads stay open";
        if announce {
            eprintln!("kvferry metadata-server: {line}");
        } else {
            tracing::info!("metadata server: {line}");
        }
    }
    rt.block_on(async move {
        let l = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        accept_loop(l, server, workers).await;
        Ok(())
    })
}

/// A connection handed to another thread's runtime.
type Handoff = (
    std::net::TcpStream,
    SocketAddr,
    tokio::sync::OwnedSemaphorePermit,
);

fn announce_line(announce: bool, local: SocketAddr, store: &str) {
    if announce {
        println!(
            "kvferry metadata-server listening on http://{local}/metadata port={} ({store})",
            local.port()
        );
        let _ = std::io::stdout().flush();
    } else {
        tracing::info!("metadata server listening on http://{local}/metadata ({store})");
    }
}

/// What every serving thread shares.
struct Server {
    state: Arc<State>,
    slots: Arc<tokio::sync::Semaphore>,
    max_connections: usize,
    header_timeout: Duration,
}

/// Accepts connections; connection `i` is served here when `i % (workers + 1) == 0`, else
/// handed to worker `i % (workers + 1) - 1`.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    server: Arc<Server>,
    workers: Vec<tokio::sync::mpsc::UnboundedSender<Handoff>>,
) {
    let mut next = 0usize;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&server.slots).try_acquire_owned() else {
            tracing::warn!(
                "{} connections open (--max-connections); closing one from {peer}",
                server.max_connections
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let i = next % (workers.len() + 1);
        next = next.wrapping_add(1);
        if i == 0 {
            serve_connection(&server, stream, peer, permit);
            continue;
        }
        match stream.into_std() {
            Ok(s) => {
                if workers[i - 1].send((s, peer, permit)).is_err() {
                    tracing::warn!("a server thread is gone; closing the connection from {peer}");
                }
            }
            Err(e) => tracing::warn!("connection from {peer}: {e}"),
        }
    }
}

/// Serves one connection on the current runtime.
fn serve_connection(
    server: &Server,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let st = Arc::clone(&server.state);
    let header_timeout = server.header_timeout;
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(move |req| handle(req, Arc::clone(&st)));
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .max_buf_size(64 * 1024)
            .pipeline_flush(true)
            .serve_connection(TokioIo::new(stream), svc);
        if let Err(e) = conn.await {
            tracing::debug!("connection from {peer}: {e}");
        }
        drop(permit);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_decoded_like_mooncake() {
        assert_eq!(
            query_key(Some("key=mooncake%2Fram%2Fa")).as_deref(),
            Some("mooncake/ram/a")
        );
        assert_eq!(query_key(Some("x=1&key=a+b%20c")).as_deref(), Some("a b c"));
        assert_eq!(query_key(Some("key=%20%20")), None);
        assert_eq!(query_key(Some("key=")), None);
        assert_eq!(query_key(None), None);
        assert_eq!(query_key(Some("key=%zz%")).as_deref(), Some("%zz%"));
        assert_eq!(query_key(Some("key=%ff")), None, "invalid UTF-8");
    }

    #[test]
    fn log_replay_drops_a_torn_tail() {
        let mut log = record(OP_PUT, b"a", b"1");
        log.extend(record(OP_PUT, b"b", b"2"));
        log.extend(record(OP_DELETE, b"a", b""));
        let good = log.len();
        let torn = record(OP_PUT, b"c", b"3");
        log.extend_from_slice(&torn[..torn.len() - 3]);
        let (m, valid) = replay(&log);
        assert_eq!(valid, good);
        assert_eq!(m.len(), 1);
        assert_eq!(m["b"], Bytes::from_static(b"2"));
        let (_, v) = replay(&[0xff; 40]);
        assert_eq!(v, 0);
    }

    /// A key put again and again (an engine's descriptor at every registration) does not
    /// grow the log without bound: it is compacted while the server runs.
    #[test]
    fn a_log_is_compacted_while_the_server_runs() {
        let dir = std::env::temp_dir().join(format!(
            "kvf-wal-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let (mut w, _) = Wal::open(&dir).unwrap();
        let mut map = HashMap::new();
        for i in 0..40u8 {
            let v = Bytes::from(vec![i; 1 << 20]);
            w.append(&record(OP_PUT, b"desc", &v)).unwrap();
            map.insert("desc".to_string(), v);
            w.maybe_compact(&map);
            let on_disk = std::fs::metadata(dir.join(LOG_NAME)).unwrap().len();
            assert_eq!(on_disk, w.len);
            assert!(
                on_disk <= 3 * (1 << 20) + COMPACT_FLOOR,
                "the log grew to {on_disk} bytes after {} puts of 1 MiB",
                i + 1
            );
        }
        drop(w);
        let (_, back) = Wal::open(&dir).unwrap();
        assert_eq!(
            back.get("desc"),
            Some(&Bytes::from(vec![39u8; 1 << 20])),
            "the last put survives compactions and a restart"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write that fails part way (a full disk) is answered as failed and leaves nothing:
    /// changes acknowledged after it are still there after a restart (before, replay stopped
    /// at the torn record and the compaction dropped everything after it).
    #[test]
    fn a_failed_append_leaves_nothing_and_later_changes_survive_a_restart() {
        let dir = std::env::temp_dir().join(format!(
            "kvf-wal-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let (mut w, _) = Wal::open(&dir).unwrap();
        w.append(&record(OP_PUT, b"a", b"1")).unwrap();
        let torn = record(OP_PUT, b"b", b"2");
        let e = w.append_with(&torn, |f, r| {
            f.write_all(&r[..r.len() / 2])?;
            Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
        });
        assert!(e.is_err());
        w.append(&record(OP_PUT, b"c", b"3")).unwrap();
        drop(w);
        let (_, map) = Wal::open(&dir).unwrap();
        assert_eq!(map.get("a"), Some(&Bytes::from_static(b"1")));
        assert_eq!(
            map.get("b"),
            None,
            "the failed change was answered as failed"
        );
        assert_eq!(
            map.get("c"),
            Some(&Bytes::from_static(b"3")),
            "acknowledged after the failure, kept"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
