//! Replication to standbys that acknowledge in memory (`--ha-replication standbys`).
//!
//! What this is: the leader streams every journal entry (the same [`Change`]s the etcd journal
//! holds) over TCP to the standbys, which acknowledge them and apply them to an in-memory
//! [`Image`] (their *mirror*); while at least one standby is **in sync**, a request is answered
//! once every in-sync standby acknowledged its changes (tens of microseconds on one host),
//! instead of after an etcd transaction (about a millisecond, and etcd's CPU). What it is not:
//! a consensus protocol. etcd stays the one arbiter of who leads and of who may:
//!
//! - **The in-sync set lives in etcd** (`mooncake-store/<id>/replication/insync`, a JSON
//!   [`InSync`] record naming the term that wrote it), changed only by the leader in
//!   transactions guarded by its view key. A standby joins it only after it acknowledged an
//!   image of the state and every entry after it up to the last one written; it leaves it
//!   (before anything more is acknowledged) when it fails to acknowledge within the bound or
//!   its connection breaks.
//! - **While the set is not empty the etcd journal is not written** (its entries stop at the
//!   moment the first standby joined), so only a member of the set may lead next: the
//!   campaign's transaction compares the record's revision, and a master that is not a member
//!   campaigns only when no member is registered with a complete mirror of the record's term
//!   any more (every member dead, or restarted without its mirror: it then starts *empty*:
//!   objects are lost, never served from a stale journal: see [`Eligibility`]).
//! - **When the set becomes empty** (its last member failed) the leader first writes a whole
//!   snapshot of its state to the etcd journal and clears the set in the same guarded
//!   transaction as the journal's new head; only then does it acknowledge again, now after etcd.
//! - **A member that wins** starts from its mirror, writes it to the etcd journal as a snapshot
//!   and clears the set before it serves, so the cluster is never without a complete copy
//!   outside a single process for longer than one failure.
//! - **A member that stops** (SIGTERM) while it holds the only copy ([`needed_at_stop`]: the
//!   leader dead, no other member alive) seals its mirror, wins once the leader's key is gone
//!   and hands its state to etcd before it exits (`super::hand_off`); beside a leader alive,
//!   its sealed mirror makes the leader drop it from the set, and it goes.
//!
//! Wire format (sans-IO, [`encode_frame`] / [`decode_frame`], over [`crate::frame`], the
//! codec the master's RPC uses too): a frame is a u32 little-endian length (at most
//! [`MAX_FRAME`]) and the postcard encoding of a [`ToStandby`] or [`ToLeader`]. A connection
//! starts with `Hello`; then `Image` frames (the state after entry `seq`, the last one
//! marked), then `Entry` frames in order, with a `Base` frame now and then
//! (where the leader's etcd journal is whole, to a standby that registered as taking it:
//! [`MirrorTail`]); the standby answers `Ack` with the last entry it holds (decoded and in
//! order; applied to its image right after). With a cluster key (`KVFERRY_AUTH_KEY_FILE`,
//! `kvferry::auth`) the connection opens with the Noise handshake of [`HA_LINK`], the leader
//! dialing the standby's [`standby_identity`] (its cluster and member id): `AuthHello` (the
//! leader's opening message) → `AuthChallenge` (the standby's answer), plain frames; every
//! frame after, both ways, is sealed under the session (`kvferry::auth::Sealer::seal_frame`:
//! the sealed length, then the sealed postcard body), the `Hello` first
//! (`prove_to_standby`, and the standby's side in `accept_leader`).

use crate::frame;
use crate::master::changes::{Change, Image, Rebuilt, ReplicaRec, PREBUILT_TERM};
use crate::master::State;
use crate::repl::{Feed, MirrorTail};
pub use crate::repl::{KeptFrame, ToLeader, ToStandby};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Read;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The largest frame either side accepts (an image is sent in frames of [`IMAGE_PIECE`]
/// changes; one entry is at most what one group commit collected).
pub const MAX_FRAME: usize = 256 << 20;
/// Changes per `Image` frame.
pub const IMAGE_PIECE: usize = 4096;

/// The Noise protocol of a replication link (`kvferry::auth`): the leader opens it, the
/// standby answers.
pub const HA_LINK: kvferry::auth::Protocol = kvferry::auth::Protocol("kvferry/ha-link/1");

/// The identity a leader dials on a replication link and a standby answers to: its cluster
/// and member id (its RPC address), so that a link made for one standby is refused by any
/// other (a relay, or a stale address).
pub fn standby_identity(cluster_id: &str, member: &str) -> String {
    format!(
        "standby/{}/{member}",
        cluster_id.strip_suffix('/').unwrap_or(cluster_id)
    )
}

/// The wire number of [`ToStandby::AuthHello`].
pub(super) const AUTH_HELLO: u8 = 5;

/// One frame: length, then postcard ([`frame::encode`], at most [`MAX_FRAME`]).
pub fn encode_frame<T: Serialize>(m: &T) -> Result<Vec<u8>, String> {
    frame::encode(m, MAX_FRAME).map_err(|e| match e {
        frame::EncodeError::Encode(e) => format!("encoding a replication frame: {e}"),
        frame::EncodeError::TooLarge(t) => format!(
            "a replication frame of {} bytes is over the limit of {MAX_FRAME}",
            t.len
        ),
    })
}

/// The first frame in `buf` and the bytes it took; `None` while `buf` holds only part of it
/// ([`frame::split`]). A length over [`MAX_FRAME`] or a body that does not decode is an error,
/// never a panic.
pub fn decode_frame<T: for<'de> Deserialize<'de>>(
    buf: &[u8],
) -> Result<Option<(T, usize)>, String> {
    let not_ours = "the peer is not a kvferry master of this version";
    let Some((body, took)) = frame::split(buf, MAX_FRAME).map_err(|t| {
        format!(
            "a replication frame claims {} bytes (at most {MAX_FRAME}): {not_ours}",
            t.len
        )
    })?
    else {
        return Ok(None);
    };
    let m = frame::decode_body(body)
        .map_err(|e| format!("a replication frame does not decode ({e}): {not_ours}"))?;
    Ok(Some((m, took)))
}

/// Reads one frame from a blocking stream.
pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, String> {
    read_frame_max(r, MAX_FRAME)
}

/// The largest hello a standby reads (before it knows the peer is a leader) and the largest
/// frame a leader reads from a standby (an acknowledgement or a refusal).
pub const MAX_SMALL_FRAME: usize = 64 << 10;

/// Reads one frame of at most `max` bytes from a blocking stream. Memory grows with the bytes
/// that arrive (at most 1 MiB is reserved on the length's word alone), so a peer that claims a
/// large frame and sends nothing costs nothing.
pub fn read_frame_max<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> Result<T, String> {
    read_frame_raw(r, max).map(|(m, _)| m)
}

/// [`read_frame_max`], with the frame as it came (length and body, as [`encode_frame`] makes
/// it): a standby keeps the entries' frames for a takeover ([`Mirror::take`]).
pub fn read_frame_raw<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> Result<(T, Vec<u8>), String> {
    let mut len = [0u8; frame::PREFIX_LEN];
    r.read_exact(&mut len).map_err(|e| e.to_string())?;
    let n = frame::body_len(len, max.min(MAX_FRAME)).map_err(|t| format!("a replication frame claims {} bytes (at most {} here): the peer is not a kvferry master of this version", t.len, t.max))?;
    let mut body = Vec::with_capacity(frame::PREFIX_LEN + n.min(1 << 20));
    body.extend_from_slice(&len);
    r.take(n as u64)
        .read_to_end(&mut body)
        .map_err(|e| e.to_string())?;
    match decode_frame(&body)? {
        Some((m, _)) => Ok((m, body)),
        None => Err("a replication frame is cut short".into()),
    }
}

/// `mooncake-store/<id>/replication/`.
pub fn prefix(cluster_id: &str) -> String {
    let id = cluster_id.strip_suffix('/').unwrap_or(cluster_id);
    format!("mooncake-store/{id}/replication/")
}

pub fn insync_key(cluster_id: &str) -> String {
    format!("{}insync", prefix(cluster_id))
}

/// Where a standby announces its replication address (under its own lease): the key ends
/// with its RPC address, its member id.
pub fn standby_key(cluster_id: &str, member: &str) -> String {
    format!("{}standby/{member}", prefix(cluster_id))
}

pub fn standby_prefix(cluster_id: &str) -> String {
    format!("{}standby/", prefix(cluster_id))
}

pub use crate::elect::insync::{
    eligibility, needed_at_stop, parse_registration, registration, Eligibility, InSync,
    Registration, GRANTS, RUNS,
};

// ---------------------------------------------------------------- standby side

/// What the connection that feeds a mirror has said: the protocol's state, and the entries
/// received and acknowledged but not applied yet.
/// The image the received changes are applied to.
#[derive(Default)]
struct Applied {
    image: Image,
    /// Held-back replicas by when they stop mattering: two read leases after they were
    /// received, or the time the leader still held them for if longer (a write in progress
    /// whose object or segment went). Pruned once that passed, so the mirror does not grow.
    held: BinaryHeap<Reverse<(Instant, ReplicaRec)>>,
}

/// What a standby's mirror holds (`/ha_status`'s `mirror`, and metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MirrorStatus {
    /// The term of the leader it mirrors (or last mirrored).
    pub term: i64,
    /// The last entry of that leader it holds (what it acknowledged): the leader's journal
    /// `seq` minus this is the standby's lag.
    pub seq: u64,
    /// It holds an image and every entry since: a mirror this member could lead from.
    pub complete: bool,
    /// A leader's connection feeds it now.
    pub fed: bool,
    /// This master is stopping: the mirror is fed no more.
    pub sealed: bool,
    /// Changes acknowledged and not applied to the image yet.
    pub pending_changes: usize,
    /// Objects in the image.
    pub objects: usize,
    /// Bytes of entries' frames kept for a takeover ([`MirrorTail`]), and the entry where the
    /// newest run of them starts (where the leader said its etcd journal is whole).
    pub tail_bytes: usize,
    pub tail_base: Option<u64>,
}

/// The master's state built ahead from a mirror whose feed ended ([`Mirror::prebuild`]).
#[derive(Default)]
enum Prebuild {
    #[default]
    None,
    /// Being built from the mirror's image (taken out of it meanwhile) of this many objects.
    /// Only the build's own end replaces it (until then the mirror holds no image: a take
    /// waits for it).
    Building { objects: usize },
    /// Built at `at` (the master's clock, ms) for [`PREBUILT_TERM`] from the mirror as it was
    /// with `seq` its last entry, fed by connection number `conn` (a hello since makes
    /// another number, and the mirror another).
    Built {
        conn: u64,
        seq: u64,
        at: u64,
        state: Box<State>,
        rebuilt: Rebuilt,
    },
}

impl Prebuild {
    /// A state built from the mirror as `f` says it is now (no hello since, the same last
    /// entry, nothing received after).
    fn built_for(&self, f: &Feed) -> bool {
        matches!(self, Prebuild::Built { conn, seq, .. } if *conn == f.next_conn && *seq == f.seq && f.pending.is_empty())
    }
}

/// How a mirror builds a master's state ahead ([`Mirror::prebuild`]): the master's clock
/// (what [`crate::node::Master::now`] counts from) and the read lease TTL in ms.
#[derive(Debug, Clone, Copy)]
pub struct Prebuilder {
    pub clock: Instant,
    pub lease_ms: u64,
}

/// What a takeover leads from ([`Mirror::take`]).
pub enum Taken {
    /// The image: the takeover builds the state ([`Image::into_state`]).
    Image(Image),
    /// The state built ahead at `at` (ms), to make the term's ([`State::retarget`]).
    Built {
        state: Box<State>,
        rebuilt: Rebuilt,
        at: u64,
    },
}

/// A standby's copy of the leader's state, fed by [`super::standby::serve`].
///
/// A frame is acknowledged once it is decoded and checked to be the next one (so held in
/// this process's memory, as the acknowledgement promises) and applied to the image after
/// that (by `follow`, the connection's thread), so the leader does not wait for the map's
/// work. What is pending is at most what one read of the connection brought; a takeover
/// applies it first.
pub struct Mirror {
    /// Lock order: `prebuilt`, `applied`, then `feed`.
    applied: Mutex<Applied>,
    /// The state built ahead once the feed ended (the leader died, or its link broke): the
    /// takeover that may follow once the dead leader's lease runs out then does not rebuild
    /// it (about 1.5 s per million objects on the 2-vCPU VM). Signalled when a build ends.
    prebuilt: Mutex<Prebuild>,
    prebuilt_done: std::sync::Condvar,
    /// How it is built (`None`: never built ahead).
    prebuilder: Option<Prebuilder>,
    /// The cluster key a leader must prove before its `Hello` (`KVFERRY_AUTH_KEY_FILE`).
    pub(super) auth: Option<kvferry::auth::ClusterKey>,
    /// This standby's member id (its RPC address): with the key, a leader dials
    /// [`standby_identity`] of it and the cluster.
    pub(super) member: String,
    feed: Mutex<Feed>,
    /// The socket of the connection that feeds it, shut down by [`Mirror::seal`] (an idle
    /// leader would otherwise learn only at its next entry that the standby left). Lock
    /// order: after `feed`.
    sock: Mutex<Option<TcpStream>>,
    /// The feed's clock starts here ([`Feed::pending`]'s times).
    epoch: Instant,
    /// The leader etcd names, as this standby last read it (its key's create revision and
    /// lease): only that leader may feed the mirror.
    leader: Mutex<Option<(i64, i64)>>,
    pub(super) cluster_id: String,
    /// How long a held-back replica is kept (two read lease TTLs).
    keep_held: Duration,
}

pub(super) fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mirror {
    /// `tail_cap`: the bytes of entries' frames a run keeps for a takeover ([`MirrorTail`];
    /// 0: none, the takeover then writes the whole state to etcd).
    pub fn new(cluster_id: &str, read_lease: Duration, tail_cap: usize) -> Mirror {
        Mirror {
            applied: Mutex::new(Applied::default()),
            prebuilt: Mutex::new(Prebuild::None),
            prebuilt_done: std::sync::Condvar::new(),
            prebuilder: None,
            auth: None,
            member: String::new(),
            feed: Mutex::new(Feed::new(tail_cap)),
            sock: Mutex::new(None),
            epoch: Instant::now(),
            leader: Mutex::new(None),
            cluster_id: cluster_id.to_string(),
            keep_held: read_lease * 2,
        }
    }

    /// Builds the master's state ahead once the feed ends ([`Mirror::prebuild`]).
    pub fn with_prebuilder(mut self, p: Prebuilder) -> Mirror {
        self.prebuilder = Some(p);
        self
    }

    /// Follows only a leader that proves `key` (and proves it to the leader), dialing this
    /// standby, member `member` of the mirror's cluster ([`standby_identity`]).
    pub fn with_auth(mut self, key: Option<kvferry::auth::ClusterKey>, member: &str) -> Mirror {
        self.auth = key;
        self.member = member.to_string();
        self
    }

    /// Builds the master's state from a complete mirror that nothing feeds (its connection
    /// ended: the leader died, or its link broke), for a takeover that may follow
    /// ([`Mirror::take`]); the image is taken out of the mirror meanwhile. Kept only while no
    /// hello came since: a leader that links again sends a new image, and the one built is
    /// dropped (at its hello). Nothing without a [`Prebuilder`], or when a state was built
    /// or is being built already.
    pub fn prebuild(&self) {
        let Some(pb) = self.prebuilder else { return };
        let (image, conn, seq) = {
            let mut p = locked(&self.prebuilt);
            if !matches!(*p, Prebuild::None) {
                return;
            }
            let mut a = locked(&self.applied);
            let mut f = locked(&self.feed);
            if !f.complete || f.closed || f.conn != 0 {
                return;
            }
            self.put_all(&mut a, std::mem::take(&mut f.pending));
            let image = Self::image_with_held(&mut a);
            *p = Prebuild::Building {
                objects: image.objects(),
            };
            (image, f.next_conn, f.seq)
        };
        let at = pb.clock.elapsed().as_millis() as u64;
        let t = Instant::now();
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            image.into_state(PREBUILT_TERM, at, pb.lease_ms)
        }));
        let mut p = locked(&self.prebuilt);
        let f = locked(&self.feed);
        debug_assert!(
            matches!(*p, Prebuild::Building { .. }),
            "only the build's end replaces its marker"
        );
        let stale;
        (*p, stale) = match built {
            Ok((state, rebuilt)) if f.next_conn == conn && f.seq == seq && !f.closed => {
                tracing::info!(seq, objects = rebuilt.objects, ms = t.elapsed().as_millis() as u64, "HA replication: the leader's feed ended; this standby's state is built ahead for a takeover");
                (
                    Prebuild::Built {
                        conn,
                        seq,
                        at,
                        state: Box::new(state),
                        rebuilt,
                    },
                    None,
                )
            }
            // (A hello came meanwhile: the mirror is another one.)
            Ok((state, _)) => (Prebuild::None, Some(state)),
            Err(_) => {
                tracing::error!("HA replication: building the state ahead panicked; a takeover builds it from the mirror");
                (Prebuild::None, None)
            }
        };
        drop((f, p));
        self.prebuilt_done.notify_all();
        drop(stale);
    }

    /// The image, with the replicas still held back as [`Change::HeldUntil`]; `a` is left
    /// empty.
    fn image_with_held(a: &mut Applied) -> Image {
        let mut image = std::mem::take(&mut a.image);
        let now = Instant::now();
        for Reverse((until, replica)) in a.held.drain() {
            image.apply(Change::HeldUntil {
                replica,
                left: until.saturating_duration_since(now).as_millis() as u64,
            });
        }
        image
    }

    /// Drops a state built ahead (on a thread of its own: a million objects take a while); a
    /// build under way is left to end (it drops what it built, the mirror having changed).
    fn drop_prebuilt(p: &mut Prebuild) {
        match std::mem::take(p) {
            Prebuild::Built { state, .. } => {
                let _ = std::thread::Builder::new()
                    .name("kvf-ha-drop".into())
                    .spawn(move || drop(state));
            }
            other => *p = other,
        }
    }

    /// Applies every pending change to the image.
    pub fn apply_pending(&self) {
        self.apply_pending_at(Instant::now());
    }

    /// [`Mirror::apply_pending`] at `now` (held-back replicas that stopped mattering by then
    /// are dropped).
    fn apply_pending_at(&self, now: Instant) {
        let mut a = locked(&self.applied);
        let pending = std::mem::take(&mut locked(&self.feed).pending);
        self.put_all(&mut a, pending);
        while a
            .held
            .peek()
            .is_some_and(|Reverse((until, _))| *until < now)
        {
            a.held.pop();
        }
    }

    fn put_all(&self, a: &mut Applied, pending: Vec<(u64, Vec<Change>)>) {
        for (at, changes) in pending {
            let at = self.epoch + Duration::from_micros(at);
            for c in changes {
                match c {
                    Change::HeldBack { replica } => {
                        a.held.push(Reverse((at + self.keep_held, replica)))
                    }
                    // (At most a day: a real leader holds for its release timeout; a
                    // larger value would overflow the clock.)
                    Change::HeldUntil { replica, left } => a.held.push(Reverse((
                        at + self
                            .keep_held
                            .max(Duration::from_millis(left.min(86_400_000))),
                        replica,
                    ))),
                    c => a.image.apply(c),
                }
            }
        }
    }

    /// What it holds now.
    pub fn status(&self) -> MirrorStatus {
        let p = locked(&self.prebuilt);
        let a = locked(&self.applied);
        let f = locked(&self.feed);
        let pending_changes = f.pending.iter().map(|(_, c)| c.len()).sum();
        let objects = match &*p {
            Prebuild::Building { objects } => *objects,
            Prebuild::Built { rebuilt, .. } if p.built_for(&f) => rebuilt.objects,
            _ => a.image.objects(),
        };
        let (tail_bytes, tail_base) = (f.tail.bytes(), f.tail.newest_base());
        MirrorStatus {
            term: f.term,
            seq: f.seq,
            complete: f.leads_from(),
            fed: f.fed(),
            sealed: f.sealed,
            pending_changes,
            objects,
            tail_bytes,
            tail_base,
        }
    }

    /// The term of a complete mirror.
    pub fn complete_term(&self) -> Option<i64> {
        let f = locked(&self.feed);
        f.leads_from().then_some(f.term)
    }

    /// The mirror of `term` for a takeover (the image, with every change received applied,
    /// the last entry received, and the entries' frames it kept: [`MirrorTail::after`]);
    /// nothing more is applied until [`Mirror::reopen`]. `None` if it is not a complete
    /// mirror of `term`.
    ///
    /// The state built ahead ([`Mirror::prebuild`]) instead of the image when it was built
    /// from this mirror as it is (a build under way is waited for).
    pub fn take(&self, term: i64) -> Option<(Taken, u64, MirrorTail)> {
        let mut p = locked(&self.prebuilt);
        while matches!(*p, Prebuild::Building { .. }) {
            p = self
                .prebuilt_done
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        let (seq, tail) = f.take(term)?;
        if p.built_for(&f) {
            if let Prebuild::Built {
                state, rebuilt, at, ..
            } = std::mem::take(&mut *p)
            {
                return Some((Taken::Built { state, rebuilt, at }, seq, tail));
            }
        }
        Self::drop_prebuilt(&mut p);
        self.put_all(&mut a, std::mem::take(&mut f.pending));
        let image = Self::image_with_held(&mut a);
        Some((Taken::Image(image), seq, tail))
    }

    /// Feeds the mirror no more (this master is stopping) and ends the connection that fed
    /// it; what it holds stays, for [`Mirror::take`].
    pub fn seal(&self) {
        let mut f = locked(&self.feed);
        f.seal();
        if let Some(sock) = locked(&self.sock).take() {
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The socket of connection `conn` (if it still feeds the mirror), for [`Mirror::seal`].
    pub(super) fn attach(&self, conn: u64, sock: &TcpStream) {
        let f = locked(&self.feed);
        if f.conn == conn && !f.sealed {
            *locked(&self.sock) = sock.try_clone().ok();
        }
    }

    /// Connection `conn` ended: nothing feeds the mirror (until a leader says hello), and its
    /// copy of the socket is closed.
    pub(super) fn detach(&self, conn: u64) {
        let mut f = locked(&self.feed);
        if f.detach(conn) {
            *locked(&self.sock) = None;
        }
    }

    /// Puts back a mirror of `term` that [`Mirror::take`] handed to a takeover that failed (so
    /// this member can campaign from it again); no connection feeds it until a leader says
    /// hello.
    pub fn restore(&self, term: i64, image: Image, seq: u64, tail: MirrorTail) {
        Self::drop_prebuilt(&mut locked(&self.prebuilt));
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        *a = Applied {
            image,
            ..Applied::default()
        };
        f.restore(term, seq, tail);
    }

    /// This master leads: nothing is mirrored (what was is dropped) until [`Mirror::reopen`].
    pub fn close(&self) {
        Self::drop_prebuilt(&mut locked(&self.prebuilt));
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        *a = Applied::default();
        f.close();
    }

    /// Accepts feeds again (after a campaign lost, or stepping down), of terms from the one it
    /// last mirrored.
    pub fn reopen(&self) {
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        if f.reopen() {
            *a = Applied::default();
        }
    }

    /// The leader key this standby read (its create revision and lease), `None` when absent.
    pub fn set_leader(&self, owner: Option<(i64, i64)>) {
        *locked(&self.leader) = owner;
    }

    /// A connection said hello: it feeds the mirror from now on (an image follows), unless it
    /// is of another cluster or an older term. Its connection id.
    pub(super) fn hello(&self, cluster_id: &str, term: i64, lease: i64) -> Result<u64, String> {
        if cluster_id != self.cluster_id {
            return Err(format!(
                "this standby serves cluster {:?}, not {cluster_id:?}",
                self.cluster_id
            ));
        }
        let named = *locked(&self.leader);
        if named != Some((term, lease)) {
            return Err(format!("term {term} (lease {lease:x}) is not the leader etcd names to this standby ({named:?}); a new leader is retried once this standby has read its key"));
        }
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        let conn = f.hello(term)?;
        *a = Applied::default();
        drop((f, a));
        // (A state built ahead is of the mirror this hello replaces; one being built is
        // dropped when its build ends.)
        Self::drop_prebuilt(&mut locked(&self.prebuilt));
        Ok(conn)
    }

    /// [`Mirror::take_frame`] of a frame encoded here.
    #[cfg(test)]
    fn apply(&self, conn: u64, frame: ToStandby) -> Result<Option<u64>, String> {
        let raw = encode_frame(&frame)?;
        self.take_frame(conn, frame, raw)
    }

    /// Takes one frame of connection `conn` (`raw` as it came; checked to be the next one;
    /// its changes pending until [`Mirror::apply_pending`]): the entry to acknowledge, if any.
    pub(super) fn take_frame(
        &self,
        conn: u64,
        frame: ToStandby,
        raw: Vec<u8>,
    ) -> Result<Option<u64>, String> {
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        locked(&self.feed).on_frame(conn, frame, raw, now)
    }
}

#[cfg(test)]
mod tests;
