//! The election: the elector thread [`super::start`] spawns. It keeps a standby's
//! registration, campaigns for the leader's key when it is free and the in-sync record lets
//! this master lead, takes over (from the etcd journal, its mirror, or empty) and renews the
//! lease while it leads. It answers no request: whether one is admitted is the
//! [`super::Gate`]'s to say, from the fence this thread keeps.

use super::fence::{Next, Renewal, Renewals};
use super::{journal, sync, HaConfig, Replication, STANDBY_POLL};
use crate::node::Master;
use kvferry::metadata::etcd::{Cond, Created, EtcdClient, Owner};
use std::collections::HashMap;
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

/// Where a campaigning master would take its state from, decided before it campaigns. The
/// mirror is only checked here, not taken: it is taken once the key is won, so that a campaign
/// that fails (no lease, a transaction lost or refused) leaves it whole for the next one (a
/// mirror given up there would leave its member, the only one alive, starting empty).
enum Plan {
    Journal,
    /// This member's complete mirror of the in-sync record's term.
    Mirror(i64),
    Empty,
}

/// Where a new leader's state comes from.
enum Source {
    Journal,
    /// The mirror, its last entry, the in-sync record's term it is of, and the entries it
    /// kept as it received them ([`sync::Mirror::take`]).
    Mirror(Box<sync::Taken>, u64, i64, Box<crate::repl::MirrorTail>),
    Empty,
}

/// The standbys registered: member -> (the mirror term its registration names, the
/// registration's mod revision).
fn registrations(
    cfg: &HaConfig,
    etcd: &EtcdClient,
) -> Result<HashMap<String, (Option<i64>, i64)>, String> {
    let p = sync::standby_prefix(&cfg.cluster_id);
    Ok(etcd
        .range(&p, &format!("{}~", p.trim_end_matches('/')), 64)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter_map(|(k, kv)| {
            Some((
                k.strip_prefix(&p)?.to_string(),
                (
                    sync::parse_registration(&String::from_utf8_lossy(&kv.value)).mirror,
                    kv.mod_revision,
                ),
            ))
        })
        .collect())
}

/// Whether this stopping master's mirror is what the next leader needs
/// ([`sync::needed_at_stop`]).
fn needed_at_stop(
    cfg: &HaConfig,
    etcd: &EtcdClient,
    mirror: &sync::Mirror,
) -> Result<bool, String> {
    let Some(term) = mirror.complete_term() else {
        return Ok(false);
    };
    let kv = etcd
        .get_kv(&sync::insync_key(&cfg.cluster_id))
        .map_err(|e| e.to_string())?;
    let rec = sync::InSync::parse(kv.as_ref().map_or(&[][..], |kv| &kv.value))?;
    if !rec.members.contains(&cfg.address) {
        return Ok(false);
    }
    let registered = registrations(cfg, etcd)?;
    Ok(sync::needed_at_stop(&rec, &cfg.address, Some(term), |m| {
        registered.get(m).is_some_and(|(t, _)| *t == Some(rec.term))
    }))
}

/// Whether this master may campaign now and from what, by the in-sync record
/// ([`sync::eligibility`]); the conditions the campaign's transaction must hold under.
fn eligible(
    cfg: &HaConfig,
    etcd: &EtcdClient,
    mirror: Option<&sync::Mirror>,
) -> Result<Option<(Plan, Vec<Cond>)>, String> {
    let ikey = sync::insync_key(&cfg.cluster_id);
    let kv = etcd.get_kv(&ikey).map_err(|e| e.to_string())?;
    let rec = sync::InSync::parse(kv.as_ref().map_or(&[][..], |kv| &kv.value))?;
    let mut conds = vec![Cond::ModRevision(
        ikey,
        kv.as_ref().map_or(0, |kv| kv.mod_revision),
    )];
    let registered = if rec.members.is_empty() {
        HashMap::new()
    } else {
        registrations(cfg, etcd)?
    };
    let rule = sync::eligibility(
        &rec,
        &cfg.address,
        mirror.and_then(sync::Mirror::complete_term),
        |m| registered.get(m).is_some_and(|(t, _)| *t == Some(rec.term)),
    );
    Ok(match rule {
        sync::Eligibility::Journal => Some((Plan::Journal, conds)),
        sync::Eligibility::Wait => None,
        sync::Eligibility::Mirror => Some((Plan::Mirror(rec.term), conds)),
        sync::Eligibility::Empty => {
            // Every other member's registration as it was read (absent, or without a mirror of
            // the record's term): one that registers or gains that mirror meanwhile fails the
            // campaign.
            conds.extend(rec.members.iter().filter(|m| **m != cfg.address).map(|m| {
                Cond::ModRevision(
                    sync::standby_key(&cfg.cluster_id, m),
                    registered.get(m).map_or(0, |r| r.1),
                )
            }));
            Some((Plan::Empty, conds))
        }
    })
}

pub(super) fn campaign(
    cfg: &HaConfig,
    etcd: &EtcdClient,
    key: &str,
    master: &Master,
    mut standby: Option<Standby>,
) {
    let gate = &master.gate;
    let ttl_secs = cfg.lease_ttl.as_secs_f64().ceil() as i64;
    let mut last_err = String::new();
    let mut logged_leader = String::new();
    let mut waiting_logged = false;
    let mut failed_takeovers = 0u32;
    // The last leader seen while standing by: its key's creation (see "An etcd that lost its
    // data").
    let mut seen: Option<Owner> = None;
    let mut report = |e: String| {
        if e != last_err {
            tracing::warn!("HA: {e}");
            last_err = e;
        }
    };
    // Stopping, this member holds what the next leader needs: it leads once more, only to
    // hand its state to etcd.
    let mut bequeath = false;
    loop {
        if gate.stopping.load(Ordering::Acquire) {
            // Stopping (SIGTERM): never campaign again, even if the key is free now, unless
            // this member's mirror is the only copy of what the next leader needs (the leader
            // dead, no other member alive): it then takes over once the leader's key is gone
            // and hands off as a leader that stops does ([`hand_off`]), unless a leader alive
            // drops it from the in-sync set first (its mirror, sealed, acknowledges nothing
            // more).
            match standby
                .as_ref()
                .map_or(Ok(false), |sb| needed_at_stop(cfg, etcd, &sb.mirror))
            {
                Ok(true) => {
                    if let Some(sb) = standby.as_ref().filter(|_| !bequeath) {
                        sb.mirror.seal();
                        tracing::info!("HA: stopping; this in-sync standby's mirror is the only copy of what the next leader needs: it leads once the leader's key is gone, only to hand its state to etcd (unless a leader alive drops it from the in-sync set first)");
                    }
                    bequeath = true;
                }
                Err(e) => {
                    // (Only with a complete mirror.) etcd cannot say: keep trying (the stop's
                    // bound ends it).
                    report(format!(
                        "stopping: whether this standby's mirror is still needed: {e}"
                    ));
                    std::thread::sleep(STANDBY_POLL);
                    continue;
                }
                Ok(false) => {
                    if let Some(sb) = standby.as_mut() {
                        sb.deregister(etcd);
                    }
                    gate.set_standby(None);
                    return;
                }
            }
        }
        if let Some(sb) = standby.as_mut() {
            if let Err(e) = sb.register(cfg, etcd) {
                report(e);
            }
        }
        match etcd.get_kv(key) {
            Ok(Some(kv)) => {
                seen = Some(Owner::of(&kv));
                if let Some(sb) = standby.as_ref() {
                    sb.mirror.set_leader(Some((kv.create_revision, kv.lease)));
                }
                gate.set_standby(Some(&kv));
                let leader = String::from_utf8_lossy(&kv.value).into_owned();
                if leader != logged_leader {
                    tracing::info!(
                        term = kv.create_revision,
                        "HA: standby; the leader is {leader}"
                    );
                    logged_leader = leader;
                }
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
            Ok(None) => {
                if let Some(sb) = standby.as_ref() {
                    sb.mirror.set_leader(None);
                }
            }
            Err(e) => {
                gate.set_standby(None);
                report(e.to_string());
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
        }
        // The key is absent: campaign, if the in-sync set lets this master lead (in either
        // mode: a master that journals to etcd only must not load a journal that stopped
        // when standbys took over acknowledging).
        let (plan, conds) = match eligible(cfg, etcd, standby.as_ref().map(|sb| &*sb.mirror)) {
            // A stopping member leads only from its mirror.
            Ok(Some((plan, _))) if bequeath && !matches!(plan, Plan::Mirror(_)) => {
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
            Ok(Some(x)) => {
                waiting_logged = false;
                x
            }
            Ok(None) => {
                if !waiting_logged {
                    tracing::info!("HA: no leader, and an in-sync standby other than this master is alive: only it may lead; waiting");
                    waiting_logged = true;
                }
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
            Err(e) => {
                report(e);
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
        };
        let sent = Instant::now();
        let lease = match etcd.lease_grant(ttl_secs) {
            Ok((id, _)) => id,
            Err(e) => {
                report(e.to_string());
                std::thread::sleep(STANDBY_POLL);
                continue;
            }
        };
        match etcd.create_when(key, cfg.address.as_bytes(), lease, &conds) {
            Ok(Created::Won(term)) => {
                let owner = Owner {
                    create_revision: term,
                    lease,
                };
                // (SeqCst with `hand_off`'s: one of the two sees the other. A stop that came
                // while this master campaigned gives the key back untouched, unless it won
                // to lead from its mirror: that may be the only copy, so it takes over and
                // hands off as any stopping member that holds it does.)
                gate.taking_over.store(true, Ordering::SeqCst);
                if gate.stopping.load(Ordering::SeqCst) && !matches!(plan, Plan::Mirror(_)) {
                    gate.taking_over.store(false, Ordering::SeqCst);
                    let _ = etcd.delete_if_owned(key, owner);
                    let _ = etcd.lease_revoke(lease);
                    if let Some(sb) = standby.as_mut() {
                        sb.deregister(etcd);
                    }
                    gate.set_standby(None);
                    return;
                }
                // The mirror is taken now that the key is won (nothing is mirrored from here
                // on); it cannot have changed since it was found complete: no leader is named,
                // so no hello is accepted.
                let source = match plan {
                    Plan::Journal => Some(Source::Journal),
                    Plan::Empty => Some(Source::Empty),
                    Plan::Mirror(rec_term) => standby
                        .as_ref()
                        .and_then(|sb| sb.mirror.take(rec_term))
                        .map(|(image, seq, tail)| {
                            Source::Mirror(Box::new(image), seq, rec_term, Box::new(tail))
                        }),
                };
                if let Some(sb) = standby.as_ref() {
                    sb.mirror.close();
                }
                // A mirror handed to a takeover that fails is put back (this member may
                // campaign from it again: etcd may still name it in sync).
                let mirrored = match &source {
                    Some(Source::Mirror(_, seq, rec_term, tail)) => {
                        Some((*seq, *rec_term, (**tail).clone()))
                    }
                    _ => None,
                };
                // Until the takeover ends, the key's lease and this member's registration are
                // renewed by a thread of their own: a takeover of a large state outlasts the
                // TTL, and with the key gone another master would campaign, and with this
                // member's registration gone (while the in-sync record still names it) it would
                // start empty. The registration goes once this master leads (a leader is not a
                // standby) and its takeover has emptied the in-sync set.
                let reg = standby.as_ref().and_then(|sb| sb.reg.map(|(l, _)| l));
                let taken = match source {
                    None => Err(
                        "this member's mirror was no longer complete when it won the key"
                            .to_string(),
                    ),
                    Some(source) => renewing(cfg, etcd, &[Some(lease), reg], || {
                        take_over(cfg, etcd, key, master, owner, sent, seen, source)
                    }),
                };
                gate.taking_over.store(false, Ordering::SeqCst);
                // After a takeover that failed, the next campaign waits, longer each time up to
                // the lease TTL (a journal that cannot be read fails every takeover: without a
                // pause each master would loop through grant, create, load and delete, adding
                // etcd revisions as fast as etcd answers).
                failed_takeovers = if taken.is_ok() {
                    0
                } else {
                    failed_takeovers.saturating_add(1)
                };
                match taken {
                    Ok(writer) => {
                        if let Some(sb) = standby.as_mut() {
                            sb.deregister(etcd);
                        }
                        logged_leader = cfg.address.clone();
                        std::thread::scope(|sc| {
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
                            lead(cfg, etcd, key, master, owner);
                            gate.set_standby(None);
                            master.journal.deactivate();
                        });
                    }
                    Err(e) => {
                        tracing::warn!(
                            term,
                            "HA: won the key but cannot take over: {e}; stepping down"
                        );
                        if let (Some(sb), Some((seq, rec_term, tail))) =
                            (standby.as_ref(), mirrored)
                        {
                            // Nothing was served: the state installed is the mirror.
                            let now = master.now();
                            let st = master.lock();
                            if st.term == term {
                                let mut image = crate::master::journal::Image::default();
                                for c in st.image(now) {
                                    image.apply(c);
                                }
                                sb.mirror.restore(rec_term, image, seq, tail);
                            }
                        }
                    }
                }
                // Stepping down: refuse, forget, let the others take over at once. The key is
                // deleted only if it is still this creation: after etcd lost its data another
                // master's key may carry the same revision (but never this lease).
                gate.set_standby(None);
                master.journal.deactivate();
                master.reset(-1);
                if let Some(sb) = &standby {
                    sb.mirror.reopen();
                }
                if let Err(e) = etcd.delete_if_owned(key, owner) {
                    tracing::debug!("HA: deleting the key after stepping down: {e}");
                }
                if let Err(e) = etcd.lease_revoke(lease) {
                    tracing::debug!("HA: revoking the lease after stepping down: {e}");
                }
                gate.stepped_down.fetch_add(1, Ordering::AcqRel);
                tracing::warn!(term, "HA: stepped down; metadata reset; standing by");
                if failed_takeovers > 0 {
                    std::thread::sleep(
                        (STANDBY_POLL * (1u32 << failed_takeovers.min(6))).min(cfg.lease_ttl),
                    );
                }
            }
            // (The mirror was not taken: it stays as it is for the next campaign.)
            Ok(Created::Lost(kv)) => {
                let _ = etcd.lease_revoke(lease);
                gate.set_standby(kv.as_ref());
            }
            Err(e) => {
                let _ = etcd.lease_revoke(lease);
                report(e.to_string());
                std::thread::sleep(STANDBY_POLL);
            }
        }
    }
}

/// Runs `f`, renewing `leases` (the `Some` ones) every keepalive period meanwhile, on a thread
/// of its own; a renewal that fails is logged and tried again at the next period (`f` checks
/// the key itself before it serves).
fn renewing<T>(
    cfg: &HaConfig,
    etcd: &EtcdClient,
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
    std::thread::scope(|sc| {
        let keeper = std::thread::Builder::new()
            .name("kvf-ha-takeover-keepalive".into())
            .spawn_scoped(sc, || {
                let mut last = Instant::now();
                while !done.load(Ordering::Acquire) {
                    std::thread::park_timeout(cfg.keepalive_every().saturating_sub(last.elapsed()));
                    if done.load(Ordering::Acquire) || last.elapsed() < cfg.keepalive_every() {
                        continue;
                    }
                    last = Instant::now();
                    for lease in leases.iter().flatten() {
                        if let Err(e) = etcd.lease_keepalive(*lease) {
                            tracing::warn!("HA: renewing lease {lease:x} during the takeover: {e}");
                        }
                    }
                }
            });
        let _done = Done(&done, keeper.as_ref().ok().map(|k| k.thread().clone()));
        f()
    })
}

/// Loads the state `source` names into `master` for `term` and starts serving: the writer
/// of the term, to run. A leader that starts from a mirror or empty first writes its state to
/// the etcd journal (and empties the in-sync set) before it serves.
#[allow(clippy::too_many_arguments)]
fn take_over<'a>(
    cfg: &HaConfig,
    etcd: &'a EtcdClient,
    key: &str,
    master: &'a Master,
    owner: Owner,
    won_at: Instant,
    seen: Option<Owner>,
    source: Source,
) -> Result<journal::Writer<'a>, String> {
    let (term, lease) = (owner.create_revision, owner.lease);
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
                Some((loaded.seq, loaded.head, loaded.last_leader)),
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
    let (seq, head, last_leader, stored) = match loaded {
        Some((seq, head, last)) => (seq, head, last, seq),
        None => {
            let (stored, head) = journal::stored_seq(etcd, &cfg.cluster_id)?;
            (
                mirror_seq,
                head,
                journal::last_leader(etcd, &cfg.cluster_id)?,
                stored,
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
        prefix: journal::prefix(&cfg.cluster_id),
        owner,
        seq,
        head,
        snapshot_bytes: cfg.snapshot_bytes,
        sync,
        insync_key: sync::insync_key(&cfg.cluster_id),
        retry_until: Some(Instant::now() + 5 * cfg.lease_ttl),
    };
    let t_write = Instant::now();
    let tail = tail.and_then(|t| t.after(stored, mirror_seq));
    let from_tail = match rebase {
        true => Some(writer.rebase_at_takeover(stored, seq, tail).ok_or("could not make the etcd journal whole (the HA journal errors logged above say why; it campaigns again once etcd answers)")?),
        false => None,
    };
    let written = t_write.elapsed();
    // etcd kept its history only if the journal names the leader this master saw (its key's
    // revision and lease); otherwise an old leader may still answer until its fence bound ends.
    if last_leader.is_none() || last_leader != seen {
        let wait = (won_at + cfg.fence_bound()).saturating_duration_since(Instant::now());
        tracing::info!(term, journal_leader = ?last_leader, ?seen, "HA: etcd's history does not show the previous leader; waiting {wait:?} (one fence bound) before serving");
        std::thread::sleep(wait);
    }
    // Renewed, and the key read back as this creation: a wait or a slow load may have let the
    // lease lapse, or another master remove the key.
    let sent = Instant::now();
    match etcd.lease_keepalive(lease) {
        Ok(Some(_)) => {}
        Ok(None) => return Err("the lease expired while loading the journal".into()),
        Err(e) => return Err(format!("renewing the lease after loading the journal: {e}")),
    }
    match etcd.get_kv(key) {
        Ok(Some(kv)) if owner.holds(&kv) => {}
        Ok(other) => {
            return Err(format!(
                "the key {key} is no longer this master's ({other:?})"
            ))
        }
        Err(e) => {
            return Err(format!(
                "reading the key back after loading the journal: {e}"
            ))
        }
    }
    master
        .gate
        .set_leader(term, &cfg.address, lease, sent, cfg.fence_bound());
    // From now on a failed write is retried only while this leader can prove its lease.
    writer.retry_until = None;
    tracing::info!(
        term,
        objects = rebuilt.objects,
        segments = rebuilt.segments,
        dropped_replicas = rebuilt.dropped_replicas,
        dropped_objects = rebuilt.dropped_objects,
        rebuild_ms = rebuild.as_millis() as u64,
        prebuilt,
        etcd_write_ms = written.as_millis() as u64,
        etcd_wrote = match from_tail {
            Some(true) => "the entries after the etcd journal's position",
            Some(false) => "the whole state",
            None => "nothing",
        },
        etcd_tail_entries = master.journal.stats().rebase_tail_entries,
        "HA: leader at {} (key {key}, lease {lease:x}); state from {from}",
        cfg.address
    );
    Ok(writer)
}

/// Keeps the lease alive while the key is ours; returns when leadership cannot be proven.
/// The decisions are [`Renewals`]'; this moves time and etcd's answers into them.
fn lead(cfg: &HaConfig, etcd: &EtcdClient, key: &str, master: &Master, owner: Owner) {
    let (term, lease) = (owner.create_revision, owner.lease);
    let gate = &master.gate;
    let bound = cfg.fence_bound().as_millis() as u64;
    let mut renewals = Renewals::new(
        term,
        cfg.keepalive_every().as_millis() as u64,
        bound,
        gate.now(),
    );
    loop {
        let sent = Instant::now();
        let now = gate.ms(sent);
        let next = renewals.poll(&mut gate.st(), now);
        match next {
            Next::StepDown => return,
            Next::Wait(until) => {
                std::thread::sleep(Duration::from_millis(until.saturating_sub(now).max(1)))
            }
            Next::Renew => {
                let outcome = match etcd.lease_keepalive(lease) {
                    Ok(Some(_)) => match etcd.get_kv(key) {
                        Ok(Some(kv)) if owner.holds(&kv) => Renewal::Ours,
                        Ok(other) => {
                            tracing::warn!(term, "HA: the key {key} is no longer this master's ({other:?}); stepping down");
                            Renewal::KeyLost
                        }
                        Err(e) => {
                            tracing::warn!(term, "HA: reading the key back: {e}");
                            Renewal::Failed
                        }
                    },
                    Ok(None) => {
                        tracing::warn!(
                            term,
                            "HA: etcd no longer knows this master's lease (expired); stepping down"
                        );
                        Renewal::LeaseLost
                    }
                    Err(e) => {
                        tracing::warn!(term, "HA: renewing the lease: {e}");
                        Renewal::Failed
                    }
                };
                if renewals.on_renewal(&mut gate.st(), gate.ms(sent), outcome) {
                    return;
                }
            }
        }
    }
}
