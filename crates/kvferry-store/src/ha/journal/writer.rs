//! The writer of one term: takes what requests queued, makes it durable (appended to etcd,
//! or streamed to the in-sync standbys and released by their acknowledgements), links and
//! promotes standbys, and gives up (fencing the leader) when etcd cannot be written while the
//! lease can be proven. A driver: it moves changes between the queue, etcd and the links;
//! the rules of what is durable are the machines' ([`crate::repl`]), and where the etcd
//! journal lies, which entry comes next, when a snapshot is due and what it deletes, and when
//! a failed transaction is given up, [`JournalWriter`]'s: this carries its transactions out
//! and tells it what was written.

use super::snapshot::Frozen;
use super::*;
use crate::repl::roster::{Leave, Polled, Registered, Roster, Stop};
use crate::repl::writer::{Answer, Next, Txn};

/// Sends `frame` to every linked standby.
pub(super) fn send_all(links: &[Link], frame: &Arc<Vec<u8>>) {
    for l in links {
        l.send(frame);
    }
}

/// The writer of one term: appends what is queued, snapshots, gives up (and fences the
/// leader) when etcd cannot be written while the leadership can still be proven.
pub struct Writer<'a> {
    pub etcd: &'a EtcdClient,
    pub master: &'a Master,
    pub view_key: String,
    /// The leader's view key's creation: its revision is the term, and this writer's
    /// transactions are guarded by it.
    pub owner: Owner,
    /// The etcd journal's bookkeeping, which decides what is written there and when (its
    /// retry bound is set during a takeover: the key won, its lease renewed by the takeover's
    /// own thread, the gate not yet the leader's; a transaction that fails is retried until
    /// then, not given up at once, as one etcd error among a large state's chunks failed the
    /// whole takeover).
    pub log: JournalWriter,
    /// Replication to standbys (`--ha-replication standbys`), `None`: etcd only.
    pub sync: Option<Replicas>,
    /// The in-sync record's key ([`crate::ha::sync::insync_key`]): emptied with the head of a
    /// rebase, in either mode.
    pub insync_key: String,
}

/// The leader's side of replication to standbys ([`crate::ha::sync`]).
pub struct Replicas {
    /// Where standbys register ([`crate::ha::sync::standby_prefix`]).
    pub standby_prefix: String,
    pub hello: ToStandby,
    /// The links' sockets (the machine, [`Replicas::roster`], knows them by member).
    pub links: Vec<Link>,
    /// Who is linked, registered, failing to link and in sync, and the decisions about them
    /// ([`Roster`]): this driver tells it what the links and etcd say, and does what it
    /// decides (the in-sync set written to etcd first).
    pub roster: Roster,
    /// Releases the entries the in-sync set acknowledged.
    pub release: Arc<Release>,
    /// How long an in-sync standby may take to acknowledge before it leaves the set.
    pub ack_timeout: Duration,
    /// While a linking standby's image is taken: the entries committed meanwhile, which it
    /// gets after its image ([`Writer::open_link`]).
    pub(super) catch_up: Option<Vec<Arc<Vec<u8>>>>,
    /// The entries the etcd journal lacks while standbys are in sync ([`Tail`]).
    pub(super) tail: Arc<Mutex<Tail>>,
    /// Bytes of space granted ahead per segment pool while standbys allow it (0: never;
    /// `Replicas::grant_bytes_now`).
    pub grant_bytes: u64,
}

impl Replicas {
    /// `tail`: the bytes of entries kept for a rebase (0: none) and the least time between
    /// two background snapshots ([`Tail`]).
    pub fn new(
        cluster_id: &str,
        me: &str,
        owner: Owner,
        ack_timeout: Duration,
        tail: (usize, Duration),
        journal: &Journal,
    ) -> Replicas {
        Replicas {
            standby_prefix: crate::ha::sync::standby_prefix(cluster_id),
            hello: ToStandby::Hello {
                cluster_id: cluster_id.to_string(),
                term: owner.create_revision,
                lease: owner.lease,
                leader: me.to_string(),
            },
            links: Vec::new(),
            roster: Roster::new(
                me,
                owner.create_revision,
                u64::try_from(crate::ha::STANDBY_POLL.as_micros()).unwrap_or(u64::MAX),
            ),
            release: Arc::new(Release::new(journal, owner.create_revision)),
            ack_timeout,
            catch_up: None,
            tail: Arc::new(Mutex::new(Tail::new(tail.0, tail.1, journal.now_us()))),
            grant_bytes: 0,
        }
    }

    /// How much space puts are granted ahead now: the configured bytes while the in-sync set
    /// is not empty (the etcd journal alone is read by masters of every version) and every
    /// linked standby reads [`Change::Granted`]; else 0.
    pub(super) fn grant_bytes_now(&self) -> u64 {
        if self.roster.grants_allowed() {
            self.grant_bytes
        } else {
            0
        }
    }

    pub(super) fn tail(&self) -> MutexGuard<'_, Tail> {
        self.tail.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn link(&self, member: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.member == member)
    }

    /// Tells the roster what each link says now (acknowledged, broken): before each of its
    /// decisions.
    pub(super) fn observe(&mut self) {
        for l in &self.links {
            self.roster.observe(&l.member, l.acked(), l.dead());
        }
    }

    /// A link opened (its image sent): the roster knows it from now on.
    pub(super) fn add_link(&mut self, link: Link) {
        self.roster.linked(
            &link.member,
            &link.addr,
            link.runs,
            link.grants,
            link.image_seq,
        );
        self.links.push(link);
    }

    /// Drops the links the roster no longer has.
    fn keep_roster_links(&mut self) {
        let r = &self.roster;
        self.links.retain(|l| r.link(&l.member).is_some());
    }

    /// Sends `changes` as entry `seq` to every linked standby, and keeps it for a standby
    /// whose image is being taken ([`Replicas::catch_up`]); none of either: nothing to do.
    /// An entry that cannot be encoded ends the term: a standby missing it must never be in
    /// sync.
    pub(super) fn broadcast(&mut self, seq: u64, changes: Vec<Change>) -> Option<()> {
        if self.links.is_empty() && self.catch_up.is_none() {
            return Some(());
        }
        match entry_frame(seq, changes).0 {
            Ok(f) => {
                send_all(&self.links, &f);
                self.tail().push(seq, &f);
                if let Some(c) = self.catch_up.as_mut() {
                    c.push(f);
                }
                Some(())
            }
            Err(e) => {
                tracing::error!("HA replication: {e}");
                None
            }
        }
    }

    /// Tells the standbys that take it where the etcd journal is whole ([`ToStandby::Base`]),
    /// right after the last entry sent (this is the writer, not lent). An encoding error is
    /// only logged: the standbys then keep no run, and a takeover writes the whole state.
    pub(super) fn base(&self, seq: u64, written: bool) {
        match crate::ha::sync::encode_frame(&ToStandby::Base { seq, written }) {
            Ok(f) => {
                let f = Arc::new(f);
                for m in self.roster.runs() {
                    if let Some(l) = self.link(m) {
                        l.send(&f);
                    }
                }
            }
            Err(e) => tracing::warn!("HA replication: {e}"),
        }
    }

    /// The in-sync set is `members` (etcd says so already).
    pub(super) fn set_insync(&mut self, members: Vec<String>, journal: &Journal) {
        self.roster.set_insync(members);
        self.insync_set(journal);
    }

    /// The roster's in-sync set is what etcd holds now: the journal's figures and the
    /// release follow it.
    pub(super) fn insync_set(&mut self, journal: &Journal) {
        journal.set_insync(self.roster.insync());
        // A member without a link acknowledges nothing (it holds every entry back until it
        // leaves the set, `Writer::check_insync`): never answered without it.
        let counters = self
            .roster
            .insync()
            .iter()
            .map(|m| {
                self.link(m)
                    .map_or_else(|| Arc::new(AtomicU64::new(0)), Link::ack_counter)
            })
            .collect();
        self.release.set_members(counters);
    }
}

impl Writer<'_> {
    pub(super) fn term(&self) -> i64 {
        self.owner.create_revision
    }

    /// One guarded transaction, retried while etcd cannot be reached and the journal's
    /// machine says so ([`JournalWriter::on_answer`]); `None` when it must give up.
    pub(super) fn txn(&self, t: &Txn) -> Option<i64> {
        let delete = t.delete.as_ref().map(|(a, b)| (a.as_str(), b.as_str()));
        loop {
            let (a, err) = match self
                .etcd
                .txn_if_owned(&self.view_key, self.owner, &t.puts, delete)
            {
                Ok(Some(rev)) => (Answer::Written(rev), None),
                Ok(None) => (Answer::NotOwner, None),
                Err(e) => (Answer::Failed, Some(e)),
            };
            let still = a == Answer::Failed && self.master.gate.still_leader(self.term());
            match self.log.on_answer(a, self.master.journal.now_us(), still) {
                Next::Done(rev) => return Some(rev),
                Next::Retry => {
                    if let Some(e) = &err {
                        tracing::warn!(term = self.term(), "HA journal: {e}; retrying");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Next::GiveUp => {
                    match err {
                        None => tracing::warn!(term = self.term(), "HA journal: the view key is no longer this leader's; nothing more is written"),
                        Some(e) => tracing::warn!(
                            term = self.term(),
                            "HA journal: {e}; the lease can no longer be proven, giving up"
                        ),
                    }
                    return None;
                }
            }
        }
    }

    /// A guarded transaction of `puts` alone.
    pub(super) fn put(&self, puts: Vec<(String, Vec<u8>)>) -> Option<i64> {
        self.txn(&Txn { puts, delete: None })
    }

    pub(super) fn append(&mut self, changes: &[Change]) -> Option<()> {
        let chunks = match encode_chunks(changes) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("HA journal: {e}");
                return None;
            }
        };
        let mut left = changes.len() as u64;
        for c in chunks {
            let n = c.len() as u64;
            let t = Instant::now();
            self.txn(&self.log.append(c))?;
            let us = t.elapsed().as_micros() as u64;
            self.log.appended(n);
            let (seq, log_bytes) = (self.log.seq(), self.log.log_bytes());
            self.master.journal.set_stats(|s| {
                s.entries += 1;
                s.changes += std::mem::take(&mut left); // counted with the first chunk
                s.write_us += us;
                s.log_bytes = log_bytes;
                s.seq = seq;
            });
        }
        Some(())
    }

    pub(super) fn streaming(&self) -> bool {
        self.sync.as_ref().is_some_and(|s| s.roster.streaming())
    }

    /// Makes `changes` durable, then acknowledges `upto`: appended to etcd while no standby is
    /// in sync, otherwise acknowledged by every in-sync standby; streamed to every linked
    /// standby either way.
    pub(super) fn commit(&mut self, changes: Vec<Change>, upto: u64) -> Option<()> {
        if let Some(s) = self.sync.as_mut().filter(|s| s.roster.streaming()) {
            // Answered when every in-sync standby acknowledged it ([`Release`]); the next
            // entry goes out without waiting for this one. A large commit goes as several
            // entries, so that the standbys' acknowledgements show their progress.
            let n = changes.len();
            for (piece, ticket) in pieces(changes, upto, ENTRY_PIECE) {
                let seq = self.log.next_seq();
                s.release.push(seq, ticket, self.master.journal.now_us());
                s.broadcast(seq, piece)?;
            }
            self.master.journal.count_streamed(n, self.log.seq());
            return Some(());
        }
        self.append(&changes)?;
        self.broadcast(changes)?;
        self.master.journal.done(upto);
        Some(())
    }

    /// Sends `changes` as the last entry to every linked standby ([`Replicas::broadcast`]).
    pub(super) fn broadcast(&mut self, changes: Vec<Change>) -> Option<()> {
        match self.sync.as_mut() {
            Some(s) => s.broadcast(self.log.seq(), changes),
            None => Some(()),
        }
    }

    /// In-sync standbys whose link broke, or that did not acknowledge the oldest pending entry
    /// within the bound, leave the set (in etcd first); then what the rest acknowledged is
    /// released.
    pub(super) fn check_insync(&mut self) -> Option<()> {
        let (failed, late) = self.failing_members();
        if failed.is_empty() {
            return Some(());
        }
        let bound = self.sync.as_ref().map(|s| s.ack_timeout);
        tracing::warn!(term = self.term(), ?late, "HA replication: the standby(s) {failed:?} did not acknowledge within {bound:?} (or their connection broke); they leave the in-sync set");
        self.drop_members(&failed)
    }

    /// The in-sync standbys whose link broke or that did not acknowledge the oldest pending
    /// entry within the bound, and that entry if it is late.
    pub(super) fn failing_members(&mut self) -> (Vec<String>, Option<u64>) {
        let now = self.master.journal.now_us();
        let Some(s) = self.sync.as_mut().filter(|s| s.roster.streaming()) else {
            return (Vec::new(), None);
        };
        s.observe();
        let late = s.release.late(now, s.ack_timeout);
        (s.roster.failing(late), late)
    }

    /// What the writer lends while it sleeps (its links, while standbys are in sync: see
    /// [`Lent`]), and how long it may sleep: an entry sent meanwhile starts its standbys'
    /// clock, so then at most one acknowledgement bound.
    pub(super) fn lend(&mut self) -> (Duration, Option<Lent>) {
        let idle = self.idle();
        let seq = self.log.seq();
        match self
            .sync
            .as_mut()
            .filter(|s| s.roster.streaming() && !s.links.is_empty())
        {
            Some(s) => (
                idle.min(s.ack_timeout),
                Some(Lent {
                    seq,
                    links: std::mem::take(&mut s.links),
                    release: Arc::clone(&s.release),
                    tail: Arc::clone(&s.tail),
                }),
            ),
            None => (idle, None),
        }
    }

    /// Takes back what [`Writer::lend`] lent, with the entries sent through it.
    pub(super) fn take_back(&mut self, lent: Option<Lent>) {
        let Some(lent) = lent else { return };
        self.log.set_seq(lent.seq);
        if let Some(s) = self.sync.as_mut() {
            s.links = lent.links;
        }
    }

    /// How long the writer may sleep before an in-sync standby may be late.
    pub(super) fn idle(&self) -> Duration {
        let idle = Duration::from_millis(200);
        match self
            .sync
            .as_ref()
            .and_then(|s| s.release.late_at(s.ack_timeout))
        {
            Some(at) => idle.min(
                Duration::from_micros(at.saturating_sub(self.master.journal.now_us()))
                    + Duration::from_millis(1),
            ),
            None => idle,
        }
    }

    /// Grants space ahead to puts, or stops (the pools' unused space goes back, as a change
    /// of the journal), as the standbys now allow ([`Replicas::grant_bytes_now`]); `off`
    /// stops regardless.
    pub(super) fn update_grants(&self, off: bool) {
        let bytes = if off {
            0
        } else {
            self.sync.as_ref().map_or(0, Replicas::grant_bytes_now)
        };
        let hold = u64::try_from(self.master.cfg.put_start_release_timeout.as_millis())
            .unwrap_or(u64::MAX);
        let mut st = self.master.lock();
        if st.term == self.term() && st.granting() != (bytes > 0) {
            tracing::info!(
                term = self.term(),
                bytes,
                "HA replication: {}",
                if bytes > 0 {
                    "puts are granted space ahead (answered before their change is acknowledged)"
                } else {
                    "puts are no longer granted space ahead"
                }
            );
        }
        if st.term == self.term() {
            st.set_grant_bytes(bytes, hold);
        }
    }

    /// Removes `gone` from the links and the in-sync set (in etcd first). When the set becomes
    /// empty the etcd journal is made whole again first ([`Writer::rebase`]).
    pub(super) fn drop_members(&mut self, gone: &[String]) -> Option<()> {
        let term = self.term();
        let Some(s) = self.sync.as_mut() else {
            return Some(());
        };
        let leave = s.roster.leave(gone);
        s.keep_roster_links();
        let rest = match leave {
            Leave::Unchanged => return Some(()),
            Leave::Rebase => return self.rebase(),
            Leave::Rest(rest) => rest,
        };
        let rec = InSync {
            term,
            members: rest.clone(),
        };
        self.put(vec![(self.insync_key.clone(), rec.to_bytes())])?;
        if let Some(s) = self.sync.as_mut() {
            s.set_insync(rest, &self.master.journal);
        }
        self.update_grants(false);
        Some(())
    }

    /// What requests queued, and the ticket that completes it (`None`: the term ended or the
    /// journal failed).
    pub(super) fn take_queued(&self) -> Option<(Vec<Change>, u64)> {
        let mut q = self.master.journal.q();
        if !q.m.live(self.term()) {
            return None;
        }
        Some(q.m.take())
    }

    /// Commits what requests queued (their changes, completing their ticket).
    pub(super) fn commit_what_is_queued(&mut self) -> Option<()> {
        let (changes, ticket) = self.take_queued()?;
        if !changes.is_empty() {
            self.commit(changes, ticket)?;
        }
        Some(())
    }

    /// Standbys that joined or left (their registrations in etcd, read every
    /// [`crate::ha::STANDBY_POLL`]): links opened (each starting with an image) or closed, as
    /// the roster decides ([`Roster::on_registrations`]).
    pub(super) fn poll_standbys(&mut self) -> Option<()> {
        let now = self.master.journal.now_us();
        let Some(s) = self.sync.as_mut() else {
            return Some(());
        };
        if !s.roster.poll(now) {
            return Some(());
        }
        let p = s.standby_prefix.clone();
        let regs: BTreeMap<String, Registered> = match self.etcd.range(&p, &prefix_end(&p), 64) {
            Ok(kvs) => kvs
                .into_iter()
                .filter_map(|(k, kv)| {
                    let v = String::from_utf8(kv.value).ok()?;
                    let r = crate::ha::sync::parse_registration(&v);
                    Some((
                        k.strip_prefix(&p)?.to_string(),
                        Registered {
                            addr: r.addr.to_string(),
                            mirror: r.mirror,
                            runs: r.runs,
                            grants: r.grants,
                        },
                    ))
                })
                .collect(),
            Err(e) => {
                tracing::debug!("HA replication: reading the standbys' registrations: {e}");
                return Some(());
            }
        };
        s.observe();
        let Polled { gone, open } = s.roster.on_registrations(now, regs);
        if !gone.is_empty() {
            self.drop_members(&gone)?;
        }
        for (member, r) in open {
            self.open_link(&member, &r.addr, r.runs, r.grants)?;
        }
        Some(())
    }

    /// Links a standby: hello, an image of the state after the last entry written (what was
    /// queued is committed first), then every entry after it. `runs`: it takes
    /// [`ToStandby::Base`] frames (its registration says so).
    pub(super) fn open_link(
        &mut self,
        member: &str,
        addr: &str,
        runs: bool,
        grants: bool,
    ) -> Option<()> {
        if !grants && self.master.lock().granting() {
            // A standby of an earlier version would not decode a grant: none is made while it
            // is linked, and the pools' return is committed before its image (the entries
            // after it hold no grant).
            self.update_grants(true);
            let _ = self.master.journal.collect(self.master);
            self.commit_what_is_queued()?;
        }
        let Some(s) = self.sync.as_mut() else {
            return Some(());
        };
        let sink: Arc<dyn AckSink> = s.release.clone();
        let mut link = match Link::open(member, addr, &s.hello, self.master.auth.clone(), sink) {
            Ok(l) => l,
            Err(e) => {
                let after = s
                    .roster
                    .link_failed(member, addr, self.master.journal.now_us());
                tracing::warn!(
                    "HA replication: {e}; retried in {:?}",
                    Duration::from_micros(after)
                );
                return Some(());
            }
        };
        (link.runs, link.grants) = (runs, grants);
        // What is queued meanwhile is committed between the image's pieces and between its
        // frames' encoding (requests do not wait for the whole image) and goes to this standby
        // after its image.
        s.catch_up = Some(Vec::new());
        let Some(Frozen { image, seq, .. }) = self.image_in_pieces(true) else {
            if let Some(s) = self.sync.as_mut() {
                s.catch_up = None;
            }
            return None;
        };
        let at = seq.unwrap_or(self.log.seq());
        // (While standbys are in sync, what was enqueued before went out as entries that only
        // their acknowledgements answer, [`Release`]: answering them here, for the link of
        // another standby, would tell clients their changes are durable before they are.)
        let objects = image.len();
        // A standby that links while others are in sync gets the entries from where the etcd
        // journal is whole up to its image, for its takeover (the others started their runs
        // there when the set filled).
        let run = match self.sync.as_ref() {
            Some(s) if runs && s.roster.streaming() => s.tail().upto(at),
            _ => None,
        };
        let started = Instant::now();
        let mut ended = false;
        let mut between = || {
            ended = self.commit_what_is_queued().is_none();
            !ended
        };
        let encoded = image_frames(at, image, IMAGE_ENCODE_HOLD, &mut between);
        let run = match (&encoded, run) {
            (Ok(_), Some((base, frames))) => {
                Some(run_frames(base, &frames, IMAGE_ENCODE_HOLD, &mut between))
            }
            _ => None,
        };
        let catch_up = self
            .sync
            .as_mut()
            .and_then(|s| s.catch_up.take())
            .unwrap_or_default();
        if ended {
            return None;
        }
        let encode_ms = started.elapsed().as_millis() as u64;
        match encoded {
            Ok(frames) => {
                link.send_image(at, &frames);
                match run {
                    Some(Ok(frames)) => frames.iter().for_each(|f| {
                        link.send(f);
                    }),
                    Some(Err(e)) => tracing::info!("HA replication: the standby {member} gets no run of entries for its takeover: {e}"),
                    None => {}
                }
                for f in &catch_up {
                    link.send(f);
                }
            }
            Err(e) => {
                tracing::error!("HA replication: {e}");
                return Some(());
            }
        }
        tracing::info!(
            term = self.term(),
            seq = self.log.seq(),
            changes = objects,
            encode_ms,
            "HA replication: the standby {member} ({addr}) linked; sending it the state"
        );
        if let Some(s) = self.sync.as_mut() {
            s.add_link(link);
        }
        Some(())
    }

    /// Standbys that acknowledged everything written join the in-sync set (in etcd first), as
    /// the roster decides ([`Roster::joining`]).
    pub(super) fn promote(&mut self) -> Option<()> {
        let term = self.term();
        let seq = self.log.seq();
        let Some(s) = self.sync.as_mut() else {
            return Some(());
        };
        s.observe();
        // (A standby whose registration does not name this term's mirror yet waits for it: a
        // member must say so in etcd before anyone relies on it, `sync::eligibility`.)
        let Some(join) = s.roster.joining(seq) else {
            return Some(());
        };
        self.put(vec![(
            self.insync_key.clone(),
            InSync {
                term,
                members: join.members.clone(),
            }
            .to_bytes(),
        )])?;
        tracing::info!(term, seq, "HA replication: {:?} in sync; requests are now acknowledged by the in-sync set {:?} instead of etcd", join.ready, join.members);
        if let Some(s) = self.sync.as_mut() {
            if join.first {
                // (Everything up to here was appended to etcd: the tail starts after it, the
                // standbys' too.)
                s.tail().start(seq, self.master.journal.now_us());
                s.base(seq, true);
            }
            s.roster.joined(&join);
            s.insync_set(&self.master.journal);
        }
        self.update_grants(false);
        Some(())
    }

    /// Runs until the term ends or writing fails (then the leader is fenced at once).
    pub fn run(mut self) {
        let j = &self.master.journal;
        if self.collect_garbage().is_none() {
            tracing::warn!(
                term = self.term(),
                "HA journal: could not delete stale snapshot chunks"
            );
        }
        let (log_bytes, snapshot_bytes) = (self.log.log_bytes(), self.log.snapshot_bytes());
        j.set_stats(|s| (s.log_bytes, s.snapshot_bytes) = (log_bytes, snapshot_bytes));
        loop {
            let (idle, lend) = self.lend();
            let (next, lent) = j.next(self.term(), idle, lend);
            self.take_back(lent);
            let Some((changes, upto)) = next else { break };
            if !changes.is_empty() && self.commit(changes, upto).is_none() {
                break;
            }
            if self.check_insync().is_none() {
                break;
            }
            if j.q().m.hand_off_asked() {
                // Stopping: the state goes to etcd whole (the in-sync set emptied), nothing
                // more is acknowledged by standbys, and the leader refuses from now on.
                let stop = self
                    .sync
                    .as_ref()
                    .map_or(Stop::Step, |s| s.roster.on_stop());
                if stop == Stop::RebaseThenStep && self.rebase().is_none() {
                    break;
                }
                self.sync = None;
                self.master.gate.fence(self.term());
                j.q().m.handed_off();
                j.wake_all();
                continue;
            }
            if self.poll_standbys().is_none() || self.promote().is_none() {
                break;
            }
            if self.log.snapshot_due(self.streaming()) && self.snapshot().is_none() {
                break;
            }
            if self.streaming()
                && self
                    .sync
                    .as_ref()
                    .is_some_and(|s| s.tail().refresh_due(j.now_us()))
                && self.refresh_base().is_none()
            {
                break;
            }
            if let Some((bytes, whole)) = self
                .sync
                .as_ref()
                .and_then(|s| s.tail().size_to_show(j.now_us()))
            {
                j.set_stats(|st| (st.tail_bytes, st.tail_whole) = (bytes, whole));
            }
        }
        self.sync = None; // links closed
        let ended = j.q().m.term() != self.term();
        if !ended {
            // Nothing more can be made durable: refuse everything from now on.
            j.fail();
            self.master.gate.fence(self.term());
        }
    }
}
