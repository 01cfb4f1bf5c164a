//! Deterministic simulation of the store's core: the real [`State`] (requests applied with
//! [`State::apply`]), the real journal changes ([`Change`], `Image`, `Image::into_state`),
//! clients whose writes land late, and leaders that crash and are followed by one rebuilt
//! from what the journal made durable: etcd's log and snapshot (a model of etcd's keys,
//! written through the real writer's machine, [`crate::repl::JournalWriter`], and read with
//! the real loader: [`etcd`]), or, for half the leaders,
//! the mirror of an in-sync standby they streamed to, released through the real
//! [`crate::repl::Pipeline`] on a network that delays entries and acknowledgements, with
//! standbys that pause and leave the set ([`standbys`]); all driven by one seeded random source and a fake
//! clock (milliseconds). After every step the invariants are checked against a reference
//! model of what clients were told:
//!
//! - space given to a put never overlaps a write that may still land there (of a put whose
//!   change was lost with a leader, a zombie, an upsert), nor an acknowledged live object;
//! - a late write never lands on the bytes of an acknowledged live object;
//! - an acknowledged put reads back with its own bytes, or its loss is explained (a segment
//!   of it was dropped); a read in flight within its lease sees the bytes it was given;
//! - a put's start delivered twice (as a network may) is never placed or applied again;
//! - etcd holds at most [`etcd::bound`] bytes under the journal's prefix: three times the
//!   largest image of the state since the current snapshot's, plus the snapshot threshold
//!   (the journal does not grow without bound with failovers, leaders that die mid-snapshot
//!   and objects put and removed over and over), and every new leader can load it;
//! - a key whose removal was acknowledged is absent at every new leader ([`Sim::check_gone`]).
//!
//! The entries the etcd journal lacks while standbys are in sync are the real kept tails'
//! ([`tail`]): rebases and takeovers write the kept run or the whole state as the machines
//! decide, standbys linked during a term get the run before their image, and background
//! snapshots start new runs; snapshots are also written with the writer's commits between
//! their chunks ([`etcd`]).
//!
//! What is not simulated yet (ARCHITECTURE.md, code map, `sim/`): the election and the
//! lease fencing (one leader at a time here, the next one starts a lease TTL after a crash;
//! `election.rs` checks those alone, with takeovers longer than the lease and what a leader
//! acknowledged as a count: `election/takeover.rs`), standbys that
//! register during a term (a leader's standbys are chosen when it starts; one that left the
//! set, or whose link broke, is linked again as the leader's roster decides), message delay
//! and reordering between clients and the master (a request is applied when sent; an answer
//! that waits for the journal is lost with its leader).
//!
//! Every seed is bounded: [`WORK`] events at most (a seed that stops making progress fails
//! with its number), and the test fails a seed that runs longer than a wall-clock bound
//! (`tests::SEED_WALL`), naming it.
//!
//! `KVFERRY_SIM_SEED=<n>` replays seed `n` alone; `KVFERRY_SIM_SEEDS=<n>` sets how many
//! seeds the test runs (default [`DEFAULT_SEEDS`]). A failure names its seed, the step and
//! the last events.

use crate::error::StoreError;
use crate::master::changes::Change;
use crate::master::{Attempt, MasterConfig, Needs, State, Stats, Strategy};
use crate::proto::{PingStatus, ReplicaDesc, ReplicateConfig, Request, Response, Segment};
use crate::repl::JournalWriter;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// The kinds of step, and how often each comes on average (per mille): each seed draws its
/// own weights around these (swarm testing: some seeds crash often, some unmount often, some
/// hardly read), so that rare sequences of one kind of event come up in some seed.
const ACTIONS: usize = 13;
const WEIGHTS: [u32; ACTIONS] = [300, 200, 150, 20, 120, 50, 20, 10, 15, 10, 105, 10, 5];

/// Seeds the test runs by default.
pub const DEFAULT_SEEDS: u64 = 5000;
/// Steps per seed.
const STEPS: usize = 1000;
/// Events a seed may take, all its steps together (a step's events: its simulated time's
/// writes landing, reads finishing, entries and acknowledgements arriving, entries made
/// durable). The most any of the default seeds takes is about 1 600 (`work_peak` in the
/// test's figures); a seed that takes more has stopped making progress (an event that comes
/// again and again at one time, as a set that empties and is never rebased does) and fails
/// with its number, instead of hanging the run.
const WORK: u64 = 20 * STEPS as u64;
/// Bytes per segment (one per client), and the granularity the simulated memory keeps.
const SEG_BYTES: u64 = 4 << 20;
const CELL: u64 = 64;
/// Times in ms: a release timeout far longer than a lease, as in a deployment (600 s and
/// 5 s by default), so a late write can outlive several failovers.
const LEASE: u64 = 500;
const RELEASE: u64 = 10_000;
const DISCARD: u64 = 5_000;
const CLIENT_TTL: u64 = 1_500;

/// What a run checks or found.
#[derive(Debug)]
pub struct Failure {
    pub seed: u64,
    pub step: usize,
    pub what: String,
    pub trace: String,
}

/// A write of a put's bytes, in flight until `land_at`.
#[derive(Debug, Clone)]
struct Write {
    tag: u32,
    seg: u64,
    addr: u64,
    len: u64,
    land_at: u64,
}

/// A put a client runs.
#[derive(Debug, Clone)]
struct Put {
    client: usize,
    key: String,
    put: u64,
    tag: u32,
    /// (segment, address, length) of each replica, once placed.
    replicas: Vec<(u64, u64, u64)>,
    /// How many times each segment had been dropped when the put was applied (a replica on
    /// one dropped since is not the object's).
    seen: BTreeMap<u64, u64>,
    /// The same, for each replica.
    gens: Vec<u64>,
    /// Its key was removed after its end was applied: acknowledged, but not live.
    removed: bool,
    /// The writes land at this time; then the put's end is sent.
    land_at: u64,
}

/// An acknowledged put, as the reference model keeps it.
#[derive(Debug, Clone)]
struct Acked {
    tag: u32,
    replicas: Vec<(u64, u64, u64)>,
    /// A segment of it was dropped: not finding it is no failure.
    may_be_lost: bool,
}

/// A read in flight: it reads its replicas at `done_at` (within the lease it was given).
#[derive(Debug, Clone)]
struct Read {
    key: String,
    /// The puts whose bytes it may find: the acknowledged one, and any whose end was applied
    /// but not acknowledged yet (an upsert).
    tags: Vec<u32>,
    replicas: Vec<(u64, u64, u64)>,
    done_at: u64,
}

/// What a client is told once the entry its answer waits for is durable.
#[derive(Debug)]
enum Reply {
    Started(Put),
    Ended(Put),
    /// The key's removal.
    Removed(String),
}

/// Changes collected, not durable yet.
struct Entry {
    /// Collections are counted (per term): the ticket the streaming pipeline releases.
    ticket: u64,
    changes: Vec<Change>,
    /// When it was collected.
    at: u64,
    /// Every grant up to this number is in it or an earlier entry.
    grants: u64,
    reply: Option<Reply>,
}

struct Client {
    id: u64,
    seg: Segment,
    mounted: bool,
    /// Pings stopped until this time (a paused client): the master may forget it.
    silent_until: u64,
    /// The master told it to remount.
    remount: bool,
}

struct Leader {
    st: State,
    term: i64,
    /// Grants up to this number are durable.
    grants_durable: u64,
}

struct Sim {
    seed: u64,
    rng: StdRng,
    now: u64,
    cfg: MasterConfig,
    stats: Stats,
    /// How often each kind of step comes in this run ([`WEIGHTS`]).
    weights: [u32; ACTIONS],
    leader: Option<Leader>,
    /// No leader until this time after a crash (the dead one's lease runs out).
    down_until: u64,
    term: i64,
    /// etcd's journal, written by the real writer's machine ([`etcd`]).
    journal: etcd::Journal,
    pending: VecDeque<Entry>,
    /// The last ticket collected in this term.
    ticket: u64,
    /// The leader streams to in-sync standbys instead of writing etcd ([`standbys`]).
    streaming: Option<standbys::Streaming>,
    /// The kept tails' caps in this run (bytes: the leader's, the standbys'; 0 keeps none)
    /// and how often at most a background snapshot starts a new run (ms).
    tail_caps: (usize, usize, u64),
    clients: Vec<Client>,
    memory: BTreeMap<u64, Vec<u32>>,
    /// How many times each segment was dropped by the master.
    dropped: BTreeMap<u64, u64>,
    writes: Vec<Write>,
    /// Puts written, whose end is to be sent (again after a failover) until answered.
    to_end: Vec<Put>,
    reads: Vec<Read>,
    model: BTreeMap<String, Acked>,
    /// Keys whose removal was acknowledged, not put (started or ended) since: no leader
    /// after any failover holds them.
    gone: std::collections::BTreeSet<String>,
    next_tag: u32,
    trace: VecDeque<String>,
    digest: u64,
    /// Events taken so far ([`WORK`]).
    work: u64,
    /// The step being run (for the trace).
    at_step: usize,
    /// Every event goes to stderr as well (`KVFERRY_SIM_TRACE=1`).
    print: bool,
    /// Every event, kept ([`run_traced`]).
    full: Option<Vec<String>>,
    pub counts: Counts,
}

fn overlaps(a: (u64, u64, u64), b: (u64, u64, u64)) -> bool {
    let cap = |l: u64| l.max(1).next_multiple_of(CELL);
    a.0 == b.0 && a.1 < b.1 + cap(b.2) && b.1 < a.1 + cap(a.2)
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let weights = WEIGHTS.map(|w| rng.random_range(0..=2 * w));
        let cfg = MasterConfig {
            lease_ttl: Duration::from_millis(LEASE),
            client_ttl: Duration::from_millis(CLIENT_TTL),
            put_start_discard_timeout: Duration::from_millis(DISCARD),
            put_start_release_timeout: Duration::from_millis(RELEASE),
            strategy: if rng.random_bool(0.5) {
                Strategy::Random
            } else {
                Strategy::FreeRatioFirst
            },
            eviction_high_watermark: 1.0,
            ..MasterConfig::default()
        };
        let n = rng.random_range(2..=4u64);
        let clients = (1..=n)
            .map(|id| Client {
                id,
                seg: Segment {
                    id: 100 + id,
                    name: format!("seg{id}"),
                    te_endpoint: format!("10.0.0.{id}:1"),
                    base: id << 32,
                    size: SEG_BYTES,
                },
                mounted: false,
                silent_until: 0,
                remount: false,
            })
            .collect::<Vec<_>>();
        let journal = etcd::Journal::new(&mut rng);
        let caps = [0, 512, 4 << 10, 1 << 20];
        let tail_caps = (
            caps[rng.random_range(0..caps.len())],
            caps[rng.random_range(0..caps.len())],
            [50, 500, 5_000][rng.random_range(0..3usize)],
        );
        let memory = clients
            .iter()
            .map(|c| (c.seg.id, vec![0u32; (SEG_BYTES / CELL) as usize]))
            .collect();
        let mut sim = Sim {
            seed,
            rng,
            now: 0,
            cfg,
            stats: Stats::default(),
            weights,
            leader: None,
            down_until: 0,
            term: 0,
            journal,
            pending: VecDeque::new(),
            ticket: 0,
            streaming: None,
            tail_caps,
            clients,
            memory,
            dropped: BTreeMap::new(),
            writes: Vec::new(),
            to_end: Vec::new(),
            reads: Vec::new(),
            model: BTreeMap::new(),
            gone: Default::default(),
            next_tag: 1,
            trace: VecDeque::new(),
            digest: 0xcbf2_9ce4_8422_2325,
            work: 0,
            at_step: 0,
            print: std::env::var_os("KVFERRY_SIM_TRACE").is_some(),
            full: None,
            counts: Counts::default(),
        };
        // (etcd is empty: nothing to fail to load.)
        let _ = sim.elect();
        for i in 0..sim.clients.len() {
            let req = Request::MountSegment {
                client: sim.clients[i].id,
                segment: sim.clients[i].seg.clone(),
            };
            if let Some(Ok(_)) = sim.request(&req, None) {
                sim.clients[i].mounted = true;
            }
        }
        sim
    }

    fn note(&mut self, s: String) {
        for b in s.bytes() {
            self.digest = (self.digest ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        if self.print {
            eprintln!("#{} t={} {s}", self.at_step, self.now);
        }
        if let Some(full) = &mut self.full {
            full.push(format!("#{} t={} {s}", self.at_step, self.now));
        }
        if self.trace.len() == 40 {
            self.trace.pop_front();
        }
        self.trace
            .push_back(format!("#{} t={} {s}", self.at_step, self.now));
    }

    /// A new leader, rebuilt from what etcd's journal holds (as the real loader reads it),
    /// whose writer continues it.
    fn elect(&mut self) -> Result<(), String> {
        self.term += 1;
        let loaded = self.journal.load()?;
        self.journal
            .start(loaded.seq, loaded.head, loaded.log_bytes);
        self.journal.flaky = true;
        let (mut st, rebuilt) = loaded.image.into_state(self.term, self.now, LEASE);
        st.seed_placement(self.rng.random());
        st.journal_on();
        // Grants on (in-sync standbys that read them) or off (none in sync), by leader.
        let grants = self.rng.random_bool(0.7);
        st.set_grant_bytes(if grants { SEG_BYTES / 64 } else { 0 }, RELEASE);
        self.note(format!(
            "leader of term {} from a snapshot of {} bytes and {} log entries ({} bytes) up to entry {}: {} objects",
            self.term,
            loaded.head.map_or(0, |h| h.bytes),
            loaded.log_entries,
            loaded.log_bytes,
            loaded.seq,
            rebuilt.objects
        ));
        self.leader = Some(Leader {
            st,
            term: self.term,
            grants_durable: 0,
        });
        self.ticket = 0;
        // Half the leaders stream to one to three in-sync standbys.
        if self.rng.random_bool(0.5) {
            let n = self.rng.random_range(1..=3);
            self.note(format!("it streams to {n} in-sync standbys"));
            let base = self.journal.writer.as_ref().map_or(0, JournalWriter::seq);
            let image = self
                .leader
                .as_ref()
                .map(|l| etcd::fixed_order(l.st.image(self.now)))
                .unwrap_or_default();
            match standbys::Streaming::new(n, self.term, base, &image, self.tail_caps, self.now) {
                Ok(s) => {
                    self.streaming = Some(s);
                    self.counts.streamed_terms += 1;
                }
                Err(e) => self.note(format!("the standbys refused the link: {e}")),
            }
        }
        // What rebuilding marked (space it holds) is the new leader's first entry.
        self.collect(None);
        Ok(())
    }

    /// The leader's marked changes as the next entry, with the reply that waits for it.
    fn collect(&mut self, reply: Option<Reply>) {
        let Some(l) = self.leader.as_mut() else {
            return;
        };
        let changes = l.st.take_changes(self.now);
        let grants = crate::master::grants_issued();
        if changes.is_empty() && reply.is_none() {
            return;
        }
        self.ticket += 1;
        self.pending.push_back(Entry {
            ticket: self.ticket,
            changes,
            at: self.now,
            grants,
            reply,
        });
    }

    /// Applies `req` at the leader: `None` without one. What waits for the journal is
    /// answered later (`reply`); the answer returned here is the one given at once.
    fn request(
        &mut self,
        req: &Request,
        reply: Option<Reply>,
    ) -> Option<Result<Response, StoreError>> {
        let now = self.now;
        let l = self.leader.as_mut()?;
        let evicted = self
            .stats
            .evicted_objects
            .load(std::sync::atomic::Ordering::Relaxed);
        let a = l.st.apply(
            &self.cfg,
            &self.stats,
            req,
            now,
            Attempt::Last,
            l.grants_durable,
            &mut None,
        );
        if self.print {
            eprintln!("  {req:?} -> {:?} {:?}", a.needs, a.result);
        }
        if self
            .stats
            .evicted_objects
            .load(std::sync::atomic::Ordering::Relaxed)
            != evicted
        {
            // Evicted objects are no longer the model's (which ones: those the state lost).
            let gone: Vec<String> = self
                .model
                .keys()
                .filter(|k| l.st.key_info(k, now).is_none_or(|i| !i.complete))
                .cloned()
                .collect();
            // (And those whose end is not acknowledged yet.)
            for e in &mut self.pending {
                if let Some(Reply::Ended(p)) = &mut e.reply {
                    p.removed |= l.st.key_info(&p.key, now).is_none_or(|i| !i.complete);
                }
            }
            for k in gone {
                self.model.remove(&k);
                self.note(format!("{k} evicted"));
            }
        }
        match (a.needs, &a.result) {
            (Needs::Journal, Ok(_)) => {
                self.collect(reply);
                return None;
            }
            (Needs::Granted, Ok(_)) => {
                self.counts.early_answers += 1;
                self.collect(None);
            }
            _ => self.collect(None),
        }
        Some(a.result)
    }

    /// One event more of the seed's budget ([`WORK`]): past it, the seed fails (it stopped
    /// making progress).
    fn spend(&mut self, step: usize) -> Result<(), Failure> {
        self.work += 1;
        self.counts.work_peak = self.work;
        if self.work > WORK {
            return Err(self.fail(
                step,
                format!(
                    "no progress: more than {WORK} events in {} steps (at t={} ms; the last events below repeat)",
                    step + 1,
                    self.now
                ),
            ));
        }
        Ok(())
    }

    fn fail(&self, step: usize, what: String) -> Failure {
        Failure {
            seed: self.seed,
            step,
            what,
            trace: self.trace.iter().map(|s| format!("  {s}\n")).collect(),
        }
    }

    fn step(&mut self, step: usize) -> Result<(), Failure> {
        self.at_step = step;
        self.spend(step)?;
        let total: u32 = self.weights.iter().sum();
        let mut roll = self.rng.random_range(0..total.max(1));
        let mut action = 0;
        while action + 1 < ACTIONS && roll >= self.weights[action] {
            roll -= self.weights[action];
            action += 1;
        }
        if self.print {
            eprintln!("#{step} t={} action {action}", self.now);
        }
        match action {
            0 => self.start_put(step)?,
            1 => self.make_durable(step)?,
            2 => {
                let by = self.rng.random_range(1..60);
                self.advance(step, by)?
            }
            3 => {
                let by = self.rng.random_range(LEASE..4 * LEASE);
                self.advance(step, by)?
            }
            4 => self.get(step)?,
            5 => self.remove(),
            6 => self.unmount_or_mount(),
            7 => self.pause_client(),
            8 => self.crash(),
            9 => self.compact(step)?,
            10 => self.upsert_or_revoke(step)?,
            11 => self.pause_standby(),
            _ => self.stop(step)?,
        }
        self.check_etcd(step)?;
        (self.counts.etcd_errors, self.counts.etcd_lost_answers) =
            (self.journal.failed, self.journal.lost_answers);
        match self.streaming.as_ref().map(standbys::Streaming::check) {
            Some(Err(e)) => Err(self.fail(step, format!("the leader's roster: {e}"))),
            _ => Ok(()),
        }
    }

    /// The writer: the first entries waiting become durable (etcd's log) and their answers
    /// go out; while streaming, what is queued goes to the standbys instead.
    fn make_durable(&mut self, step: usize) -> Result<(), Failure> {
        if self.streaming.is_some() {
            self.stream();
            self.refresh_base();
            return Ok(());
        }
        let n = self.rng.random_range(1..=self.pending.len().max(1));
        for _ in 0..n {
            let Some(e) = self.pending.pop_front() else {
                break;
            };
            self.durable(step, e, true)?;
        }
        if self.journal.writing.is_some() {
            let n = self.rng.random_range(1..=3);
            self.snapshot_more(n);
        }
        self.check_snapshot(step, false)
    }

    /// Entry `e` is durable (appended to etcd's log with `to_log`; else its standbys have it):
    /// its answer goes out.
    fn durable(&mut self, step: usize, e: Entry, to_log: bool) -> Result<(), Failure> {
        if to_log && !e.changes.is_empty() && !self.journal.append(&e.changes) {
            // Not written: its answer never goes out.
            self.writer_gave_up();
            return Ok(());
        }
        if let Some(l) = self.leader.as_mut() {
            l.grants_durable = l.grants_durable.max(e.grants);
        }
        // A put's replicas: as the state placed them (taken from the entry's change).
        let placed = match &e.reply {
            Some(Reply::Started(p)) => e.changes.iter().rev().find_map(|c| match c {
                Change::Object { key, rec } if *key == p.key => rec
                    .pending
                    .as_ref()
                    .filter(|q| q.id == p.put)
                    .map(|q| q.replicas.to_vec()),
                _ => None,
            }),
            _ => None,
        };
        match e.reply {
            Some(Reply::Started(p)) => {
                if let Some(replicas) = placed {
                    self.started(step, Put { replicas, ..p })?;
                }
            }
            Some(Reply::Ended(p)) => self.acked(p),
            // (A put of the key still to end makes it live again.)
            Some(Reply::Removed(key)) if !self.to_end.iter().any(|p| p.key == key) => {
                self.gone.insert(key);
            }
            Some(Reply::Removed(_)) => {}
            None => {}
        }
        Ok(())
    }

    fn advance(&mut self, step: usize, by: u64) -> Result<(), Failure> {
        let until = self.now + by;
        // The journal is written well within a lease, or its leader fences itself (it can no
        // longer prove its lease): the same to its clients as a crash.
        // (While streaming, the writer sends within the bound; the standbys' lateness is the
        // stream's to handle.)
        if self.streaming.is_some() {
            if self
                .pending
                .get(self.streaming.as_ref().map_or(0, standbys::Streaming::sent))
                .is_some_and(|e| until > e.at + LEASE / 2)
            {
                self.stream();
            }
        } else if self
            .pending
            .front()
            .is_some_and(|e| until > e.at + LEASE / 2)
        {
            if self.rng.random_bool(0.8) {
                while !self.pending.is_empty() {
                    self.spend(step)?;
                    self.make_durable(step)?;
                }
            } else {
                self.crash();
            }
        }
        // (The writer reads the standbys' registrations when due: what that releases is
        // placed now, its writes landing below.)
        self.poll_standbys(step)?;
        // Writes land in time order, each checked against the live objects.
        loop {
            let next = self
                .writes
                .iter()
                .map(|w| w.land_at)
                .filter(|&t| t <= until)
                .min();
            let reads_next = self
                .reads
                .iter()
                .map(|r| r.done_at)
                .chain(self.stream_next())
                .filter(|&t| t <= until)
                .min();
            let t = match (next, reads_next) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => break,
                },
            };
            self.spend(step)?;
            self.now = self.now.max(t);
            self.land(step, t)?;
            self.finish_reads(step, t)?;
            self.stream_events(step, t)?;
        }
        self.now = until;
        if self.leader.is_none() && self.now >= self.down_until {
            self.elect()
                .map_err(|e| self.fail(step, format!("no leader can load the journal: {e}")))?;
            self.counts.failovers += 1;
            self.check_gone(step)?;
        }
        self.tick();
        self.end_puts();
        Ok(())
    }

    /// The writer's machine gave up a transaction etcd failed ([`etcd::Journal::run`]): the
    /// leader fences itself at once, the same to its clients as a crash (what was not written
    /// is lost, its answers with it).
    fn writer_gave_up(&mut self) {
        if self.leader.is_none() {
            return;
        }
        self.note(format!(
            "etcd failed a transaction and the writer of term {} gave up: the leader fences itself",
            self.term
        ));
        self.counts.writer_give_ups += 1;
        self.crash();
    }

    /// The leader dies: what its journal had not made durable is lost, answers with it.
    fn crash(&mut self) {
        if self.leader.take().is_none() {
            return;
        }
        if self.journal.writing.is_some() {
            self.journal.snapshot_dropped();
            self.counts.snapshots_cut += 1;
        }
        self.note(format!(
            "leader of term {} crashes, {} entries not durable",
            self.term,
            self.pending.len()
        ));
        self.take_over_from_standby();
        self.pending.clear();
        self.down_until = self.now + LEASE;
    }

    /// The leader writes a snapshot though none is due (everything queued first), as one
    /// that stops hands its state to etcd.
    fn compact(&mut self, step: usize) -> Result<(), Failure> {
        self.check_snapshot(step, true)
    }
}

mod clients;
mod counts;
pub use counts::Counts;
pub mod election;
mod etcd;
mod standbys;
mod tail;
#[cfg(test)]
mod tests;
