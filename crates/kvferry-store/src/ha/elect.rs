//! The elector thread [`super::start`] spawns: the driver of the [`Campaign`] machine. It
//! carries the machine's requests out against etcd ([`Etcd`] for [`EtcdClient`]), keeps a
//! standby's registration, loads the state a won key names (from the etcd journal, this
//! member's mirror, or empty: [`take_over`]), runs the journal writer while the machine
//! leads, and resets the master when it steps down. Every decision (when to campaign, from
//! what, when to serve, renew, step down) is the machine's. It answers no request: whether
//! one is admitted is the [`super::Gate`]'s to say, from the fence the machine keeps.

use super::{journal, sync, HaConfig, Replication, STANDBY_POLL};
use crate::elect::fence::{Keep, TakeoverRenewals};
use crate::elect::{Answer, Campaign, Config, Etcd, Out, Plan, View};
use crate::node::Master;
use crate::repl::JournalWriter;
use kvferry::metadata::etcd::{Cond, Created, EtcdClient, KeyValue, Owner};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A standby's side of replication: its mirror, the address it serves it on, and its
/// registration in etcd.
pub(super) struct Standby {
    pub(super) mirror: Arc<sync::Mirror>,
    /// Where leaders connect (`ip:port`).
    pub(super) addr: String,
    /// The registration's lease and when it was last renewed.
    pub(super) reg: Option<(i64, Instant)>,
    /// The mirror term the registration names ([`sync::registration`]).
    pub(super) published: Option<i64>,
}

impl Standby {
    /// Keeps this standby's registration alive (granted again when etcd lost it) and naming
    /// the term of its complete mirror, if any.
    fn register(&mut self, cfg: &HaConfig, etcd: &EtcdClient) -> Result<(), String> {
        let key = sync::standby_key(&cfg.cluster_id, &cfg.address);
        let mirror = self.mirror.complete_term();
        if let Some((lease, at)) = self.reg {
            if self.published != mirror {
                etcd.put(
                    &key,
                    sync::registration(&self.addr, mirror).as_bytes(),
                    lease,
                )
                .map_err(|e| format!("updating this standby's registration: {e}"))?;
                self.published = mirror;
            }
            if at.elapsed() < cfg.keepalive_every() {
                return Ok(());
            }
            match etcd.lease_keepalive(lease) {
                Ok(Some(_)) => {
                    self.reg = Some((lease, Instant::now()));
                    return Ok(());
                }
                Ok(None) => self.reg = None,
                Err(e) => return Err(format!("renewing this standby's registration: {e}")),
            }
        }
        let ttl = cfg.lease_ttl.as_secs_f64().ceil() as i64;
        let (lease, _) = etcd
            .lease_grant(ttl)
            .map_err(|e| format!("registering this standby: {e}"))?;
        etcd.put(
            &key,
            sync::registration(&self.addr, mirror).as_bytes(),
            lease,
        )
        .map_err(|e| format!("registering this standby: {e}"))?;
        self.reg = Some((lease, Instant::now()));
        self.published = mirror;
        Ok(())
    }

    fn deregister(&mut self, etcd: &EtcdClient) {
        if let Some((lease, _)) = self.reg.take() {
            let _ = etcd.lease_revoke(lease);
        }
    }
}

impl Etcd for EtcdClient {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, String> {
        self.get_kv(key).map_err(|e| e.to_string())
    }

    fn range(&self, prefix: &str) -> Result<Vec<(String, KeyValue)>, String> {
        EtcdClient::range(
            self,
            prefix,
            &format!("{}~", prefix.trim_end_matches('/')),
            64,
        )
        .map_err(|e| e.to_string())
    }

    fn lease_grant(&self, ttl_secs: i64) -> Result<i64, String> {
        EtcdClient::lease_grant(self, ttl_secs)
            .map(|(id, _)| id)
            .map_err(|e| e.to_string())
    }

    fn create_when(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        conds: &[Cond],
    ) -> Result<Created, String> {
        EtcdClient::create_when(self, key, value, lease, conds).map_err(|e| e.to_string())
    }

    fn lease_keepalive(&self, lease: i64) -> Result<bool, String> {
        EtcdClient::lease_keepalive(self, lease)
            .map(|a| a.is_some())
            .map_err(|e| e.to_string())
    }

    fn lease_alive(&self, lease: i64) -> Result<bool, String> {
        EtcdClient::lease_ttl(self, lease)
            .map(|t| t.is_some())
            .map_err(|e| e.to_string())
    }

    fn delete_if_owned(&self, key: &str, owner: Owner) -> Result<(), String> {
        EtcdClient::delete_if_owned(self, key, owner)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn lease_revoke(&self, lease: i64) -> Result<(), String> {
        EtcdClient::lease_revoke(self, lease).map_err(|e| e.to_string())
    }
}

/// Where a new leader's state comes from, once the key is won.
enum Source {
    Journal,
    /// The mirror, its last entry, the in-sync record's term it is of, and the entries it
    /// kept as it received them ([`sync::Mirror::take`]).
    Mirror(Box<sync::Taken>, u64, i64, Box<crate::repl::MirrorTail>),
    Empty,
}

/// A takeover under way: the writer of the term, what to log once it leads, and the mirror
/// taken (put back if the takeover fails: this member may campaign from it again).
struct Taking<'a> {
    writer: Option<journal::Writer<'a>>,
    summary: String,
    mirrored: Option<(u64, i64, crate::repl::MirrorTail)>,
}

/// The elector: the machine and what it drives.
struct Elector<'a> {
    cfg: &'a HaConfig,
    etcd: &'a EtcdClient,
    key: &'a str,
    master: &'a Master,
    standby: Option<Standby>,
    m: Campaign,
    taking: Option<Taking<'a>>,
    last_err: String,
}

/// What the driver does after one output.
enum Flow {
    Go,
    Exit,
}

pub(super) fn campaign(
    cfg: &HaConfig,
    etcd: &EtcdClient,
    key: &str,
    master: &Master,
    standby: Option<Standby>,
) {
    let config = Config {
        me: cfg.address.clone(),
        key: key.to_string(),
        insync_key: sync::insync_key(&cfg.cluster_id),
        standby_prefix: sync::standby_prefix(&cfg.cluster_id),
        ttl: cfg.lease_ttl.as_millis() as u64,
        poll: STANDBY_POLL.as_millis() as u64,
        bound: cfg.fence_bound().as_millis() as u64,
        every: cfg.keepalive_every().as_millis() as u64,
    };
    let mut e = Elector {
        cfg,
        etcd,
        key,
        master,
        standby,
        m: Campaign::new(config, master.gate.now()),
        taking: None,
        last_err: String::new(),
    };
    loop {
        let out = e.poll();
        if let Flow::Exit = e.handle(out) {
            return;
        }
    }
}

impl<'a> Elector<'a> {
    fn view(&self) -> View {
        View {
            stopping: self.master.gate.stopping.load(Ordering::SeqCst),
            mirror: self
                .standby
                .as_ref()
                .and_then(|sb| sb.mirror.complete_term()),
        }
    }

    fn poll(&mut self) -> Out {
        let view = self.view();
        let gate = &self.master.gate;
        self.m.poll(gate.now(), &view, &mut gate.st())
    }

    fn handle(&mut self, out: Out) -> Flow {
        let gate = &self.master.gate;
        match out {
            Out::Wait(until) => {
                let now = gate.now();
                let ms = until
                    .saturating_sub(now)
                    .clamp(1, STANDBY_POLL.as_millis() as u64);
                std::thread::sleep(Duration::from_millis(ms));
            }
            Out::Etcd(op) => {
                let answer = self.m.execute(self.etcd, &op);
                if let Ok(Answer::Created(Created::Won(_))) = &answer {
                    // (SeqCst with `hand_off`'s: one of the two sees the other. The machine
                    // reads the stop after this.)
                    gate.taking_over.store(true, Ordering::SeqCst);
                }
                let view = self.view();
                self.m.on_etcd(gate.now(), answer, &view, &mut gate.st());
            }
            Out::Register => {
                if let Some(sb) = self.standby.as_mut() {
                    if let Err(e) = sb.register(self.cfg, self.etcd) {
                        if e != self.last_err {
                            tracing::warn!("HA: {e}");
                            self.last_err = e;
                        }
                    }
                }
            }
            Out::Leader(owner) => {
                if let Some(sb) = &self.standby {
                    sb.mirror
                        .set_leader(owner.map(|o| (o.create_revision, o.lease)));
                }
            }
            Out::Seal => {
                if let Some(sb) = &self.standby {
                    sb.mirror.seal();
                }
            }
            Out::TakeOver { owner, plan } => return self.take_over(owner, plan),
            Out::Lead { owner } => return self.lead(owner),
            Out::StepDown { owner, failed } => self.step_down(owner, failed),
            Out::SteppedDown { term } => {
                gate.stepped_down.fetch_add(1, Ordering::AcqRel);
                tracing::warn!(term, "HA: stepped down; metadata reset; standing by");
            }
            Out::Exit => {
                gate.taking_over.store(false, Ordering::SeqCst);
                if let Some(sb) = self.standby.as_mut() {
                    sb.deregister(self.etcd);
                }
                return Flow::Exit;
            }
            Out::Info(s) => tracing::info!("HA: {s}"),
            Out::Warn(s) => tracing::warn!("HA: {s}"),
        }
        Flow::Go
    }

    /// Loads the state `plan` names, renewing the key's lease and this member's registration
    /// on a thread of their own until the takeover ends (a takeover of a large state outlasts
    /// the TTL, and with the key gone another master would campaign, and with this member's
    /// registration gone while the in-sync record still names it, it would start empty).
    fn take_over(&mut self, owner: Owner, plan: Plan) -> Flow {
        let (cfg, etcd, key, master) = (self.cfg, self.etcd, self.key, self.master);
        // The mirror is taken now that the key is won (nothing is mirrored from here on); it
        // cannot have changed since it was found complete: no leader is named, so no hello is
        // accepted.
        let source = match plan {
            Plan::Journal => Some(Source::Journal),
            Plan::Empty => Some(Source::Empty),
            Plan::Mirror(rec_term) => self
                .standby
                .as_ref()
                .and_then(|sb| sb.mirror.take(rec_term))
                .map(|(image, seq, tail)| {
                    Source::Mirror(Box::new(image), seq, rec_term, Box::new(tail))
                }),
        };
        if let Some(sb) = self.standby.as_ref() {
            sb.mirror.close();
        }
        let mirrored = match &source {
            Some(Source::Mirror(_, seq, rec_term, tail)) => {
                Some((*seq, *rec_term, (**tail).clone()))
            }
            _ => None,
        };
        let reg = self.standby.as_ref().and_then(|sb| sb.reg.map(|(l, _)| l));
        let settled = renewing(cfg, etcd, &master.gate, &[Some(owner.lease), reg], || {
            let loaded = match source {
                None => Err(
                    "this member's mirror was no longer complete when it won the key".to_string(),
                ),
                Some(source) => take_over(cfg, etcd, key, master, owner, source),
            };
            let gate = &master.gate;
            let last = match loaded {
                Ok((writer, last, summary)) => {
                    self.taking = Some(Taking {
                        writer: Some(writer),
                        summary,
                        mirrored,
                    });
                    Ok(last)
                }
                Err(e) => {
                    self.taking = Some(Taking {
                        writer: None,
                        summary: String::new(),
                        mirrored,
                    });
                    Err(e)
                }
            };
            self.m.on_taken(gate.now(), last, &mut gate.st());
            // The machine waits out the fence bound if it must and proves the lease; the
            // renewals here go on meanwhile, until it leads or steps down.
            loop {
                match self.poll() {
                    out @ (Out::Lead { .. } | Out::StepDown { .. } | Out::Exit) => return out,
                    out => {
                        if let Flow::Exit = self.handle(out) {
                            return Out::Exit;
                        }
                    }
                }
            }
        });
        self.handle(settled)
    }

    /// Serves `owner`'s term: the journal writer on a thread of its own, the machine's
    /// renewals on this one, until the machine steps down.
    fn lead(&mut self, owner: Owner) -> Flow {
        let (cfg, etcd, master) = (self.cfg, self.etcd, self.master);
        let gate = &master.gate;
        gate.taking_over.store(false, Ordering::SeqCst);
        let term = owner.create_revision;
        let (mut writer, summary) = match self.taking.take() {
            Some(Taking {
                writer: Some(w),
                summary,
                ..
            }) => (w, summary),
            // (The machine leads only after a takeover that loaded: refuse, and let its
            // renewals step down.)
            _ => {
                gate.fence(term);
                return Flow::Go;
            }
        };
        // A leader is not a standby (its takeover emptied the in-sync set).
        if let Some(sb) = self.standby.as_mut() {
            sb.deregister(etcd);
        }
        // From now on a failed write is retried only while this leader can prove its lease.
        writer.log.retry_until(None);
        tracing::info!(
            term,
            "HA: leader at {} (key {}, lease {:x}); {summary}",
            cfg.address,
            self.key,
            owner.lease
        );
        let settled = std::thread::scope(|sc| {
            let w = std::thread::Builder::new()
                .name("kvf-master-journal".into())
                .spawn_scoped(sc, move || writer.run());
            if let Err(e) = w {
                tracing::error!(
                    term,
                    "HA: cannot start the journal writer: {e}; stepping down"
                );
                gate.fence(term);
            }
            let settled = loop {
                match self.poll() {
                    out @ (Out::StepDown { .. } | Out::Exit) => break out,
                    out => {
                        let _ = self.handle(out);
                    }
                }
            };
            master.journal.deactivate();
            settled
        });
        self.handle(settled)
    }

    /// Stops serving `owner`'s term and forgets the state (the machine gives the key and the
    /// lease back next). After a takeover from this member's mirror that failed, the mirror
    /// is put back: etcd may still name it in sync, and it may campaign from it again.
    fn step_down(&mut self, owner: Owner, failed: bool) {
        let master = self.master;
        master.gate.taking_over.store(false, Ordering::SeqCst);
        let taking = self.taking.take();
        if let (true, Some(sb), Some((seq, rec_term, tail))) = (
            failed,
            self.standby.as_ref(),
            taking.and_then(|t| t.mirrored),
        ) {
            // Nothing was served: the state installed is the mirror.
            let now = master.now();
            let st = master.lock();
            if st.term == owner.create_revision {
                let mut image = crate::master::changes::Image::default();
                for c in st.image(now) {
                    image.apply(c);
                }
                sb.mirror.restore(rec_term, image, seq, tail);
            }
        }
        master.journal.deactivate();
        master.reset(-1);
        if let Some(sb) = &self.standby {
            sb.mirror.reopen();
        }
    }
}

/// Runs `f`, renewing `leases` (the `Some` ones) meanwhile on a thread of its own, when the
/// [`TakeoverRenewals`] machine says (on `gate`'s clock); a renewal that fails is logged and
/// tried again at the next period (`f` checks the key itself before it serves).
fn renewing<T>(
    cfg: &HaConfig,
    etcd: &EtcdClient,
    gate: &super::Gate,
    leases: &[Option<i64>],
    f: impl FnOnce() -> T,
) -> T {
    let done = AtomicBool::new(false);
    // Set however `f` ends (a panic too): a keeper left renewing would hold the key forever.
    struct Done<'a>(&'a AtomicBool, Option<std::thread::Thread>);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            if let Some(t) = &self.1 {
                t.unpark();
            }
        }
    }
    let leases: Vec<i64> = leases.iter().flatten().copied().collect();
    let every = cfg.keepalive_every().as_millis() as u64;
    std::thread::scope(|sc| {
        let keeper = std::thread::Builder::new()
            .name("kvf-ha-takeover-keepalive".into())
            .spawn_scoped(sc, || {
                let mut k = TakeoverRenewals::new(&leases, every, gate.now());
                while !done.load(Ordering::Acquire) {
                    match k.poll(gate.now()) {
                        Keep::Wait(until) => std::thread::park_timeout(Duration::from_millis(
                            until.saturating_sub(gate.now()),
                        )),
                        Keep::Renew(leases) => {
                            for lease in leases {
                                if let Err(e) = etcd.lease_keepalive(lease) {
                                    tracing::warn!(
                                        "HA: renewing lease {lease:x} during the takeover: {e}"
                                    );
                                }
                            }
                        }
                    }
                }
            });
        let _done = Done(&done, keeper.as_ref().ok().map(|k| k.thread().clone()));
        f()
    })
}

/// Loads the state `source` names into `master` for `owner`'s term and marks the journal:
/// the writer of the term (to run once the machine leads), the leader the journal named
/// before (revision and lease), and what to log once it leads. A leader that starts from a
/// mirror or empty first writes its state to the etcd journal (and empties the in-sync set).
fn take_over<'a>(
    cfg: &HaConfig,
    etcd: &'a EtcdClient,
    key: &str,
    master: &'a Master,
    owner: Owner,
    source: Source,
) -> Result<(journal::Writer<'a>, Option<Owner>, String), String> {
    let term = owner.create_revision;
    let lease_ms = master.cfg.lease_ttl.as_millis() as u64;
    // The state is installed before anything else is read from etcd: if the takeover of a
    // mirror fails after this, the master's state is that mirror and is put back (`campaign`).
    let (taken, from, loaded, mirror_seq, tail) = match source {
        Source::Journal => {
            let loaded = journal::load(etcd, &cfg.cluster_id)?;
            let from = format!(
                "the journal ({} log entries, {} bytes)",
                loaded.log_entries, loaded.bytes
            );
            (
                sync::Taken::Image(loaded.image),
                from,
                Some((
                    loaded.seq,
                    loaded.head,
                    loaded.last_leader,
                    loaded.log_bytes,
                )),
                0,
                None,
            )
        }
        Source::Mirror(taken, mirror_seq, _, tail) => (
            *taken,
            format!("this standby's mirror (entry {mirror_seq})"),
            None,
            mirror_seq,
            Some(tail),
        ),
        Source::Empty => {
            tracing::error!(term, "HA: the leader and every in-sync standby are gone; what only they held is lost: this leader starts EMPTY (the etcd journal is stale, and is never served)");
            (
                sync::Taken::Image(Default::default()),
                "nothing (every in-sync standby was lost)".to_string(),
                None,
                0,
                None,
            )
        }
    };
    let rebase = loaded.is_none();
    let t_rebuild = Instant::now();
    let prebuilt = matches!(taken, sync::Taken::Built { .. });
    let (mut st, rebuilt) = match taken {
        sync::Taken::Image(image) => image.into_state(term, master.now(), lease_ms),
        // (Built once the leader's feed ended, while its lease ran out.)
        sync::Taken::Built {
            mut state,
            rebuilt,
            at,
        } => {
            state.retarget(term, at, master.now(), lease_ms);
            (*state, rebuilt)
        }
    };
    let rebuild = t_rebuild.elapsed();
    st.journal_on();
    master.install(st);
    master.journal.activate(term);
    master.journal.set_stats(|s| {
        (s.takeover_rebuild_ms, s.takeover_prebuilt) = (rebuild.as_millis() as u64, prebuilt)
    });
    // (Where the etcd journal ends, when it is not loaded: a takeover from a mirror writes the
    // entries after it, if the mirror kept them all, else its whole state after the later of
    // the two.)
    // (And how much log it holds after its snapshot: counted towards the next snapshot, or
    // every short term would add its threshold of log.)
    let (seq, head, last_leader, stored, log_bytes) = match loaded {
        Some((seq, head, last, log_bytes)) => (seq, head, last, seq, log_bytes),
        None => {
            let stored = journal::stored_seq(etcd, &cfg.cluster_id)?;
            (
                mirror_seq,
                stored.head,
                journal::last_leader(etcd, &cfg.cluster_id)?,
                stored.seq,
                stored.log_bytes,
            )
        }
    };
    if !journal::mark_term(etcd, key, &cfg.cluster_id, owner)? {
        return Err("the key is no longer this master's".into());
    }
    let sync = match cfg.replication {
        Replication::Etcd => None,
        Replication::Standbys => {
            let mut r = journal::Replicas::new(
                &cfg.cluster_id,
                &cfg.address,
                owner,
                cfg.ack_timeout(),
                (
                    usize::try_from(cfg.rebase_tail_bytes).unwrap_or(usize::MAX),
                    cfg.rebase_base_every,
                ),
                &master.journal,
            );
            r.grant_bytes = cfg.grant_bytes;
            Some(r)
        }
    };
    let mut writer = journal::Writer {
        etcd,
        master,
        view_key: key.to_string(),
        owner,
        log: JournalWriter::new(
            journal::prefix(&cfg.cluster_id),
            seq,
            head,
            log_bytes,
            cfg.snapshot_bytes,
        ),
        sync,
        insync_key: sync::insync_key(&cfg.cluster_id),
    };
    writer.log.retry_until(Some(
        master.journal.now_us()
            + u64::try_from((5 * cfg.lease_ttl).as_micros()).unwrap_or(u64::MAX),
    ));
    let t_write = Instant::now();
    let from_tail = match rebase {
        true => Some(writer.rebase_at_takeover(stored, seq, tail.as_deref()).ok_or("could not make the etcd journal whole (the HA journal errors logged above say why; it campaigns again once etcd answers)")?),
        false => None,
    };
    let written = t_write.elapsed();
    Ok((
        writer,
        last_leader,
        format!(
            "state from {from}: {} objects, {} segments, {} replicas and {} objects dropped; rebuilt in {} ms (prebuilt: {prebuilt}); etcd written in {} ms ({}, {} tail entries)",
            rebuilt.objects,
            rebuilt.segments,
            rebuilt.dropped_replicas,
            rebuilt.dropped_objects,
            rebuild.as_millis(),
            written.as_millis(),
            match from_tail {
                Some(true) => "the entries after the etcd journal's position",
                Some(false) => "the whole state",
                None => "nothing",
            },
            master.journal.stats().rebase_tail_entries,
        ),
    ))
}
