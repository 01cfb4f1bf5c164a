//! The master's HTTP side: `/metrics` (Prometheus text format 0.0.4), `/health`,
//! `/query_key?key=`, `/get_all_segments`, and HA's `/role` (`leader` or `standby`, plain
//! text, as Mooncake), `/leader` (Mooncake's JSON: `present`, `leader_address`,
//! `view_version` = the term) and `/ha_status` (JSON: role, term, cluster id, key, leader,
//! lease TTL, age of the last renewal, time left before fencing, the journal, the in-sync set,
//! and a standby's mirror: term, last entry held, objects). Without HA the master is
//! the leader of term 0.
//!
//! With the cluster key (`KVFERRY_AUTH_KEY_FILE`, the master's `Config`) the routes that show
//! the store's contents (`/query_key`, `/get_all_segments`, `/ha_status`: keys, their
//! placement, segments, clients' addresses, the HA members and journal) answer only requests
//! signed with it (`X-Kvferry-Auth`, `kvferry::auth_http`: within 30 s of this master's clock,
//! each nonce taken once), and 401 with the cause and the fix otherwise. The probes
//! (`/health`, `/metrics`, `/role`, `/leader`: counts, the role and the leader's address, which
//! `/health` shows too) stay open, as load balancers and scrapers hold no key, unless
//! `--http-auth-all` closes them too. Every route is a GET: none changes state.
//!
//! Values are read from the master at scrape time (under its lock), so the exposition is
//! written directly rather than mirrored into a metrics registry that would duplicate state.

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use kvferry_store::ha::Role;
use kvferry_store::master::OP_NAMES;
use kvferry_store::Master;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn reply(status: StatusCode, ctype: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// The leader's journal figures (`/metrics`): what `JournalStats` holds, as the journal's
/// writer last set it (a rebase's `rebase_ms`, the kept tail's size and whether it is whole).
fn journal_metrics(o: &mut String, j: &kvferry_store::ha::journal::JournalStats) {
    let _ = writeln!(o, "# HELP kvferry_master_ha_journal_lag Collected state changes not yet written to the etcd journal (leader; replication lag).\n# TYPE kvferry_master_ha_journal_lag gauge\nkvferry_master_ha_journal_lag {}", j.lag);
    let _ = writeln!(o, "# HELP kvferry_master_ha_journal_seq The last entry of this leader's journal (written to etcd or streamed to the in-sync standbys).\n# TYPE kvferry_master_ha_journal_seq gauge\nkvferry_master_ha_journal_seq {}", j.seq);
    let _ = writeln!(o, "# HELP kvferry_master_ha_journal_entries_total Journal entries written to etcd in this term.\n# TYPE kvferry_master_ha_journal_entries_total counter\nkvferry_master_ha_journal_entries_total {}", j.entries);
    let _ = writeln!(o, "# HELP kvferry_master_ha_journal_bytes Bytes of the journal in etcd: the current snapshot plus the log after it.\n# TYPE kvferry_master_ha_journal_bytes gauge\nkvferry_master_ha_journal_bytes {}", j.snapshot_bytes + j.log_bytes);
    let _ = writeln!(o, "# HELP kvferry_master_ha_early_answers_total Puts answered before their start was acknowledged in this term (placed in space granted ahead: --ha-grant-bytes).\n# TYPE kvferry_master_ha_early_answers_total counter\nkvferry_master_ha_early_answers_total {}", j.early_answers);
    let _ = writeln!(o, "# HELP kvferry_master_ha_insync_standbys Standbys that acknowledge the leader's changes in memory (its in-sync set); 0: the etcd journal acknowledges them.\n# TYPE kvferry_master_ha_insync_standbys gauge\nkvferry_master_ha_insync_standbys {}", j.insync);
    let _ = writeln!(o, "# HELP kvferry_master_ha_streamed_entries_total Entries acknowledged by the in-sync standbys in this term.\n# TYPE kvferry_master_ha_streamed_entries_total counter\nkvferry_master_ha_streamed_entries_total {}", j.streamed);
    let _ = writeln!(o, "# HELP kvferry_master_ha_tail_bytes Bytes of the entries the leader keeps for its next rebase (what the etcd journal lacks while standbys are in sync); 0 with kvferry_master_ha_tail_whole 0: none kept, the next rebase writes the whole state.\n# TYPE kvferry_master_ha_tail_bytes gauge\nkvferry_master_ha_tail_bytes {}", j.tail_bytes);
    let _ = writeln!(o, "# HELP kvferry_master_ha_tail_whole 1 while the kept entries are every one since the etcd journal was last whole.\n# TYPE kvferry_master_ha_tail_whole gauge\nkvferry_master_ha_tail_whole {}", u8::from(j.tail_whole));
    let _ = writeln!(o, "# HELP kvferry_master_ha_rebase_seconds How long the last rebase (the in-sync set emptied) held changing requests.\n# TYPE kvferry_master_ha_rebase_seconds gauge\nkvferry_master_ha_rebase_seconds {}", j.rebase_ms as f64 / 1000.0);
}

fn query_param(uri: &hyper::Uri, name: &str) -> Option<String> {
    form_urlencoded::parse(uri.query()?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

pub fn metrics_text(m: &Master) -> String {
    let s = m.summary_recent();
    let mut o = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge(
        "kvferry_master_keys",
        "Objects readable in the pool.",
        s.keys as f64,
    );
    gauge(
        "kvferry_master_bytes_used",
        "Bytes allocated to replicas.",
        s.bytes_used as f64,
    );
    gauge(
        "kvferry_master_bytes_total",
        "Bytes contributed by mounted segments.",
        s.bytes_total as f64,
    );
    gauge(
        "kvferry_master_clients",
        "Clients that pinged within their TTL.",
        s.clients as f64,
    );
    gauge(
        "kvferry_master_segments",
        "Mounted segments.",
        s.segments as f64,
    );
    gauge(
        "kvferry_master_pending_puts",
        "Puts started and not yet ended.",
        s.pending_puts as f64,
    );
    let _ = writeln!(o, "# HELP kvferry_master_ops_total Operations handled, by kind.\n# TYPE kvferry_master_ops_total counter");
    for (i, op) in OP_NAMES.iter().enumerate() {
        let _ = writeln!(
            o,
            "kvferry_master_ops_total{{op=\"{op}\"}} {}",
            m.stats.ops[i].load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(o, "# HELP kvferry_master_errors_total Operations that returned an error, by kind.\n# TYPE kvferry_master_errors_total counter");
    for (i, op) in OP_NAMES.iter().enumerate() {
        let _ = writeln!(
            o,
            "kvferry_master_errors_total{{op=\"{op}\"}} {}",
            m.stats.errors[i].load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(o, "# HELP kvferry_master_evicted_objects_total Objects evicted.\n# TYPE kvferry_master_evicted_objects_total counter\nkvferry_master_evicted_objects_total {}", m.stats.evicted_objects.load(Ordering::Relaxed));
    let c = &m.cleanup.stats;
    let _ = writeln!(o, "# HELP kvferry_master_metadata_cleanup_total Segments of clients that stopped pinging, by what became of their metadata entries (--enable-metadata-cleanup-on-timeout): removed, kept (the engine answers, or the name is mounted again), failed (after every retry).\n# TYPE kvferry_master_metadata_cleanup_total counter");
    for (outcome, n) in [
        ("removed", &c.removed),
        ("kept", &c.kept),
        ("failed", &c.failed),
    ] {
        let _ = writeln!(
            o,
            "kvferry_master_metadata_cleanup_total{{outcome=\"{outcome}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
    let ha = m.gate.status();
    let _ = writeln!(o, "# HELP kvferry_master_ha_enabled Whether this master campaigns for leadership (--enable-ha).\n# TYPE kvferry_master_ha_enabled gauge\nkvferry_master_ha_enabled {}", u8::from(ha.enabled));
    let _ = writeln!(o, "# HELP kvferry_master_ha_is_leader 1 while this master leads (answers requests), 0 while it stands by.\n# TYPE kvferry_master_ha_is_leader gauge\nkvferry_master_ha_is_leader {}", u8::from(ha.role == Role::Leader));
    let _ = writeln!(o, "# HELP kvferry_master_ha_term The current leader's term (the etcd create revision of its key; 0 without HA or while unknown).\n# TYPE kvferry_master_ha_term gauge\nkvferry_master_ha_term {}", ha.term);
    journal_metrics(&mut o, &m.journal.stats());
    if let Some(mi) = m.gate.mirror_status() {
        let _ = writeln!(o, "# HELP kvferry_master_ha_mirror_seq The last entry of the leader's journal this standby's mirror holds (acknowledged); the leader's kvferry_master_ha_journal_seq minus this is its lag.\n# TYPE kvferry_master_ha_mirror_seq gauge\nkvferry_master_ha_mirror_seq {}", mi.seq);
        let _ = writeln!(o, "# HELP kvferry_master_ha_mirror_complete 1 while this standby's mirror holds an image and every entry since (it could lead from it).\n# TYPE kvferry_master_ha_mirror_complete gauge\nkvferry_master_ha_mirror_complete {}", u8::from(mi.complete));
        let _ = writeln!(o, "# HELP kvferry_master_ha_mirror_objects Objects in this standby's mirror.\n# TYPE kvferry_master_ha_mirror_objects gauge\nkvferry_master_ha_mirror_objects {}", mi.objects);
    }
    if let Some(age) = ha.last_keepalive_age_ms {
        let _ = writeln!(o, "# HELP kvferry_master_ha_keepalive_age_seconds Time since the last successful lease renewal was sent (leader).\n# TYPE kvferry_master_ha_keepalive_age_seconds gauge\nkvferry_master_ha_keepalive_age_seconds {}", age as f64 / 1000.0);
    }
    let _ = writeln!(o, "# HELP kvferry_master_evicted_bytes_total Bytes evicted.\n# TYPE kvferry_master_evicted_bytes_total counter\nkvferry_master_evicted_bytes_total {}", m.stats.evicted_bytes.load(Ordering::Relaxed));
    o
}

/// Who may read the HTTP routes when the master holds the cluster key.
pub struct HttpAuth {
    guard: kvferry::auth_http::Guard,
    /// `--http-auth-all`: the probes need a signed request too.
    all: bool,
}

impl HttpAuth {
    pub fn new(key: kvferry::auth::ClusterKey, all: bool) -> HttpAuth {
        HttpAuth {
            guard: kvferry::auth_http::Guard::new(key),
            all,
        }
    }
}

/// The routes open to every client (probes) unless `--http-auth-all`.
const PROBES: [&str; 4] = ["/health", "/metrics", "/role", "/leader"];
/// The routes that need a signed request whenever the master holds the key.
const GUARDED: [&str; 3] = ["/query_key", "/get_all_segments", "/ha_status"];

/// The refusal to answer `req` with, or `None` when it may be served.
fn refusal(
    auth: Option<&HttpAuth>,
    req: &Request<hyper::body::Incoming>,
) -> Option<Response<Full<Bytes>>> {
    let auth = auth?;
    let path = req.uri().path();
    if !(GUARDED.contains(&path) || (auth.all && PROBES.contains(&path))) {
        return None;
    }
    let header = req
        .headers()
        .get(kvferry::auth_http::HEADER)
        .map(|v| v.as_bytes());
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
    // (A GET's body is not read: the signature is of an empty one.)
    auth.guard
        .verify(
            req.method().as_str(),
            pq,
            header,
            b"",
            kvferry::auth_http::now_ms(),
        )
        .err()
        .map(|why| {
            let status = StatusCode::from_u16(why.status()).unwrap_or(StatusCode::UNAUTHORIZED);
            let mut r = reply(
                status,
                "text/plain; charset=utf-8",
                format!("{path} refused: {why}\n"),
            );
            if status == StatusCode::UNAUTHORIZED {
                r.headers_mut().insert(
                    hyper::header::WWW_AUTHENTICATE,
                    hyper::header::HeaderValue::from_static(kvferry::auth_http::HEADER),
                );
            }
            r
        })
}

fn route(
    m: &Master,
    auth: Option<&HttpAuth>,
    req: &Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET is served here\n".into(),
        );
    }
    if let Some(refused) = refusal(auth, req) {
        return refused;
    }
    match req.uri().path() {
        "/metrics" => reply(StatusCode::OK, "text/plain; version=0.0.4", metrics_text(m)),
        "/health" => {
            let s = m.summary_recent();
            let ha = m.gate.status();
            let leader = (!ha.leader.is_empty()).then_some(&ha.leader);
            let body = serde_json::json!({"status": "ok", "role": ha.role, "service_ready": ha.role == Role::Leader, "ha": ha.enabled, "leader_address": leader, "view_version": ha.term, "summary": s});
            reply(StatusCode::OK, "application/json", body.to_string())
        }
        "/role" => reply(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            if m.gate.role() == Role::Leader {
                "leader".into()
            } else {
                "standby".into()
            },
        ),
        "/leader" => {
            let ha = m.gate.status();
            let body = if ha.enabled && ha.leader.is_empty() {
                serde_json::json!({"present": false})
            } else if ha.enabled {
                serde_json::json!({"present": true, "leader_address": ha.leader, "view_version": ha.term})
            } else {
                serde_json::json!({"present": true, "leader_address": null, "view_version": 0})
            };
            reply(StatusCode::OK, "application/json", body.to_string())
        }
        "/ha_status" => reply(
            StatusCode::OK,
            "application/json",
            serde_json::to_string(&m.ha_status()).unwrap_or_default(),
        ),
        "/get_all_segments" => {
            // Nothing mounted: an empty body, as Mooncake's master (SGLang's `check_server`
            // waits while the body is empty).
            let segs = m.lock().segments_info();
            let body = if segs.is_empty() {
                String::new()
            } else {
                serde_json::to_string(&segs).unwrap_or_default()
            };
            reply(StatusCode::OK, "application/json", body)
        }
        "/query_key" => match query_param(req.uri(), "key") {
            None => reply(
                StatusCode::BAD_REQUEST,
                "text/plain",
                "missing ?key=\n".into(),
            ),
            Some(k) => match m.lock().key_info(&k, m.now()) {
                Some(info) => reply(
                    StatusCode::OK,
                    "application/json",
                    serde_json::to_string(&info).unwrap_or_default(),
                ),
                None => reply(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    format!("key {k:?} not found\n"),
                ),
            },
        },
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "routes: /metrics /health /role /leader /ha_status /query_key?key= /get_all_segments\n"
                .into(),
        ),
    }
}

/// Most connections the admin HTTP serves at once, and from one source address: a flood of
/// idle or slow connections holds at most these (each at most 30 s and a request head of at
/// most `MAX_HEAD` bytes), and probes from other hosts are still answered.
const MAX_CONNS: usize = 256;
const MAX_CONNS_PER_SOURCE: usize = 32;
/// Largest request head read (hyper's buffer; the routes take no body).
const MAX_HEAD: usize = 16 << 10;

/// Serves the admin HTTP on `listener` until the process ends; with `auth`, only signed
/// requests to the routes it guards.
pub fn serve(listener: TcpListener, m: Arc<Master>, auth: Option<HttpAuth>) -> std::io::Result<()> {
    let auth = auth.map(Arc::new);
    let places = kvferry::auth::Unproved::new(MAX_CONNS, MAX_CONNS_PER_SOURCE);
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        loop {
            let (stream, from) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: the admin HTTP stays up (health probes
                    // would otherwise fail for good), backing off instead of spinning.
                    tracing::warn!("master HTTP: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(place) = places.admit(from.ip()) else {
                tracing::debug!("master HTTP: {MAX_CONNS} connections served, or {MAX_CONNS_PER_SOURCE} from {}; closing a new one", from.ip());
                continue;
            };
            let (m, auth) = (Arc::clone(&m), auth.clone());
            tokio::spawn(async move {
                let _place = place;
                let svc = hyper::service::service_fn(move |req| {
                    let r = route(&m, auth.as_deref(), &req);
                    async move { Ok::<_, Infallible>(r) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(30),
                    hyper::server::conn::http1::Builder::new().max_buf_size(MAX_HEAD).serve_connection(io, svc),
                )
                .await;
            });
        }
    })
}

#[cfg(test)]
mod tests {
    /// The figures a rebase leaves (how long it held changing requests, the kept entries
    /// none and not whole after it; kept and whole while standbys are in sync) read back from
    /// `/metrics` as they are in `JournalStats` (what `/ha_status` shows).
    #[test]
    fn the_rebase_and_kept_tail_figures_are_the_journals() {
        use kvferry_store::ha::journal::JournalStats;
        let line = |o: &str, name: &str| {
            o.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_string))
        };
        let mut o = String::new();
        let j = JournalStats {
            rebase_ms: 1_250,
            rebase_tail_entries: 12,
            tail_bytes: 0,
            tail_whole: false,
            ..JournalStats::default()
        };
        super::journal_metrics(&mut o, &j);
        assert_eq!(
            line(&o, "kvferry_master_ha_rebase_seconds").as_deref(),
            Some("1.25"),
            "{o}"
        );
        assert_eq!(
            line(&o, "kvferry_master_ha_tail_whole").as_deref(),
            Some("0")
        );
        assert_eq!(
            line(&o, "kvferry_master_ha_tail_bytes").as_deref(),
            Some("0")
        );
        let mut o = String::new();
        let j = JournalStats {
            rebase_ms: 7,
            tail_bytes: 4_096,
            tail_whole: true,
            ..JournalStats::default()
        };
        super::journal_metrics(&mut o, &j);
        assert_eq!(
            line(&o, "kvferry_master_ha_rebase_seconds").as_deref(),
            Some("0.007")
        );
        assert_eq!(
            line(&o, "kvferry_master_ha_tail_whole").as_deref(),
            Some("1")
        );
        assert_eq!(
            line(&o, "kvferry_master_ha_tail_bytes").as_deref(),
            Some("4096")
        );
    }

    #[test]
    fn query_decoding() {
        let u: hyper::Uri = "/query_key?key=a%2Fb+c&x=1".parse().unwrap();
        assert_eq!(super::query_param(&u, "key").as_deref(), Some("a/b c"));
        assert_eq!(super::query_param(&u, "nope"), None);
    }
}
