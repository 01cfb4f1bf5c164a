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
use crate::master::journal::{Change, Image, Rebuilt, ReplicaRec, PREBUILT_TERM};
use crate::master::State;
use crate::repl::{MirrorTail, TailFrame};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The largest frame either side accepts (an image is sent in frames of [`IMAGE_PIECE`]
/// changes; one entry is at most what one group commit collected).
pub const MAX_FRAME: usize = 256 << 20;
/// Changes per `Image` frame.
pub const IMAGE_PIECE: usize = 4096;

/// Leader → standby.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToStandby {
    /// The first frame: the cluster, and the leader's term (its view key's create revision)
    /// and lease.
    Hello { cluster_id: String, term: i64, lease: i64, leader: String },
    /// Part of the state after entry `seq`; the one with `last` ends the image.
    Image { seq: u64, changes: Vec<Change>, last: bool },
    /// The changes of entry `seq`, applied after every earlier one.
    Entry { seq: u64, changes: Vec<Change> },
    /// Where the leader's etcd journal is, or is about to be, whole: a standby keeps the
    /// entries after it for a takeover ([`MirrorTail`]). `written`: it is whole up to entry
    /// `seq` now (sent when the in-sync set becomes non-empty, right after entry `seq`, and
    /// once a background snapshot's head at `seq` is written: the runs from elsewhere are of
    /// no use any more). Not `written`: a background snapshot of the state after entry `seq`
    /// is being written (sent right after entry `seq`): a run starts there, and the current
    /// one is kept until the snapshot's head is. Sent only to standbys whose registration
    /// says they take it ([`registration`]'s [`RUNS`]): one of an earlier version would not
    /// decode it.
    Base { seq: u64, written: bool },
    /// To a standby that links while others are in sync (its image is after where the etcd
    /// journal is whole, `base`): the entries from there up to its image's position, as the
    /// leader sent them to the others (each the frame of the log's entries `first..=last`),
    /// in one or more of these frames ([`run_frames`], each continuing the one before) right
    /// after its image. Kept for a takeover, not applied (the image holds them): its run
    /// starts at `base`, as the others' did, once they reach its image. Only to a standby that
    /// takes [`ToStandby::Base`].
    Run { base: u64, frames: Vec<KeptFrame> },
    /// The first frame where the masters hold a cluster key, a plain one: the leader's Noise
    /// opening message ([`HA_LINK`], dialing [`standby_identity`]), answered by
    /// [`ToLeader::AuthChallenge`]. Last, so the other variants keep their wire numbers.
    AuthHello { hello: Vec<u8> },
    /// Not sent (it kept the number of an earlier exchange's step): refused wherever it comes.
    AuthProof { mac: Vec<u8> },
}

/// The Noise protocol of a replication link (`kvferry::auth`): the leader opens it, the
/// standby answers.
pub const HA_LINK: kvferry::auth::Protocol = kvferry::auth::Protocol("kvferry/ha-link/1");

/// The identity a leader dials on a replication link and a standby answers to: its cluster
/// and member id (its RPC address), so that a link made for one standby is refused by any
/// other (a relay, or a stale address).
pub fn standby_identity(cluster_id: &str, member: &str) -> String {
    format!("standby/{}/{member}", cluster_id.strip_suffix('/').unwrap_or(cluster_id))
}

/// The wire number of [`ToStandby::AuthHello`].
const AUTH_HELLO: u8 = 5;

/// The longest body of the first frame a standby holding the cluster key reads: a
/// [`ToStandby::AuthHello`] with the longest opening message. A longer length prefix is
/// refused before anything more is read.
pub const MAX_AUTH_HELLO_FRAME: usize = 1 + 2 + kvferry::auth::MAX_HELLO_LEN;

/// How long a leader's connection to a standby holding the cluster key has, from its
/// accept, to prove it: the handshake and its first sealed frame (the `Hello`), whole.
pub const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The most connections a standby holding the cluster key keeps at once that did not prove
/// it yet, in all and from one address (`crate::net`'s `Unproved`): more are closed at
/// accept. (Only leaders link, one link per standby.)
pub const MAX_UNPROVED_LINKS: (usize, usize) = (32, 8);
/// One entry's frame in a [`ToStandby::Run`]: the log's entries `first..=last`, the frame as
/// [`encode_frame`] made it (a byte string to serde, not a sequence of numbers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptFrame {
    pub first: u64,
    pub last: u64,
    pub frame: bytes::Bytes,
}

impl From<KeptFrame> for (u64, u64, Arc<Vec<u8>>) {
    /// A received run's frame as the mirror's tail keeps it ([`MirrorTail::joined`]).
    fn from(k: KeptFrame) -> Self {
        (k.first, k.last, Arc::new(Vec::from(k.frame)))
    }
}

/// Standby → leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToLeader {
    /// Everything up to entry `seq` is held (a takeover applies it).
    Ack { seq: u64 },
    /// The connection is refused (another cluster, an older term, out of order).
    Refused { why: String },
    /// To [`ToStandby::AuthHello`], a plain frame: the standby's Noise answer. Last, so the
    /// other variants keep their wire numbers.
    AuthChallenge { answer: Vec<u8> },
}

/// How a link's frames arrive: plain, or sealed under the link's session (then `next` is the
/// length of the next frame when its head was opened ahead, by [`whole_in`]).
pub(crate) enum Incoming {
    Plain,
    Sealed { opener: kvferry::auth::Opener, next: Option<usize> },
}

impl Incoming {
    fn sealed(opener: kvferry::auth::Opener) -> Incoming {
        Incoming::Sealed { opener, next: None }
    }
}

/// [`read_frame_raw`] of a link's next frame, plain or sealed ([`Incoming`]): the frame as
/// [`encode_frame`] made it (a sealed one opened). A sealed frame that does not open
/// (injected, replayed, altered on the path) is an error.
fn read_frame_in<T: for<'de> Deserialize<'de>>(r: &mut impl Read, inc: &mut Incoming, max: usize) -> Result<(T, Vec<u8>), String> {
    use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN, MAX_MSG};
    let Incoming::Sealed { opener, next } = inc else { return read_frame_raw(r, max) };
    let refused = |e: kvferry::auth::Refusal| format!("a replication frame: {e}");
    let n = match next.take() {
        Some(n) => n,
        None => {
            let mut head = [0u8; FRAME_HEAD_LEN];
            r.read_exact(&mut head).map_err(|e| e.to_string())?;
            opener.open_frame_head(&head, max.min(MAX_FRAME)).map_err(refused)?
        }
    };
    let prefix = frame::prefix(n, max.min(MAX_FRAME)).map_err(|t| refused(kvferry::auth::Refusal::FrameTooLarge(t.len, t.max)))?;
    let len = frame_body_len(n);
    // (Grown as the bytes arrive.)
    let mut sealed = Vec::with_capacity(len.min(1 << 20));
    r.take(len as u64).read_to_end(&mut sealed).map_err(|e| e.to_string())?;
    if sealed.len() != len {
        return Err("a replication frame is cut short".into());
    }
    let mut raw = Vec::with_capacity(frame::PREFIX_LEN + n);
    raw.extend_from_slice(&prefix);
    for chunk in sealed.chunks(MAX_MSG) {
        let at = raw.len();
        raw.resize(at + chunk.len(), 0);
        let k = opener.open(chunk, &mut raw[at..]).map_err(refused)?;
        raw.truncate(at + k);
    }
    match decode_frame(&raw)? {
        Some((m, _)) => Ok((m, raw)),
        None => Err("a replication frame is cut short".into()),
    }
}

/// Whether `r`'s buffer starts with a whole frame of the link ([`frame::whole`]; for a sealed
/// one its head is opened ahead, once, and taken out of the buffer).
fn whole_in(r: &mut std::io::BufReader<TcpStream>, inc: &mut Incoming) -> Result<bool, String> {
    use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN};
    use std::io::BufRead;
    let Incoming::Sealed { opener, next } = inc else { return Ok(frame::whole(r.buffer())) };
    let n = match *next {
        Some(n) => n,
        None => {
            let Some(head) = r.buffer().first_chunk::<FRAME_HEAD_LEN>() else { return Ok(false) };
            let n = opener.open_frame_head(head, MAX_FRAME).map_err(|e| format!("a replication frame: {e}"))?;
            r.consume(FRAME_HEAD_LEN);
            *next = Some(n);
            n
        }
    };
    Ok(r.buffer().len() >= frame_body_len(n))
}

/// `raw` ([`encode_frame`]) as it goes on a link: sealed, without its plain length, when the
/// link is sealed.
fn wire(sealer: Option<&mut kvferry::auth::Sealer>, raw: &[u8]) -> Vec<u8> {
    match sealer {
        None => raw.to_vec(),
        Some(sealer) => {
            let mut out = Vec::new();
            sealer.seal_frame(frame::body(raw), &mut out);
            out
        }
    }
}

/// One frame: length, then postcard ([`frame::encode`], at most [`MAX_FRAME`]).
pub fn encode_frame<T: Serialize>(m: &T) -> Result<Vec<u8>, String> {
    frame::encode(m, MAX_FRAME).map_err(|e| match e {
        frame::EncodeError::Encode(e) => format!("encoding a replication frame: {e}"),
        frame::EncodeError::TooLarge(t) => format!("a replication frame of {} bytes is over the limit of {MAX_FRAME}", t.len),
    })
}

/// The first frame in `buf` and the bytes it took; `None` while `buf` holds only part of it
/// ([`frame::split`]). A length over [`MAX_FRAME`] or a body that does not decode is an error,
/// never a panic.
pub fn decode_frame<T: for<'de> Deserialize<'de>>(buf: &[u8]) -> Result<Option<(T, usize)>, String> {
    let not_ours = "the peer is not a kvferry master of this version";
    let Some((body, took)) = frame::split(buf, MAX_FRAME).map_err(|t| format!("a replication frame claims {} bytes (at most {MAX_FRAME}): {not_ours}", t.len))? else { return Ok(None) };
    let m = frame::decode_body(body).map_err(|e| format!("a replication frame does not decode ({e}): {not_ours}"))?;
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
pub fn read_frame_max<T: for<'de> Deserialize<'de>>(r: &mut impl Read, max: usize) -> Result<T, String> {
    read_frame_raw(r, max).map(|(m, _)| m)
}

/// [`read_frame_max`], with the frame as it came (length and body, as [`encode_frame`] makes
/// it): a standby keeps the entries' frames for a takeover ([`Mirror::take`]).
pub fn read_frame_raw<T: for<'de> Deserialize<'de>>(r: &mut impl Read, max: usize) -> Result<(T, Vec<u8>), String> {
    let mut len = [0u8; frame::PREFIX_LEN];
    r.read_exact(&mut len).map_err(|e| e.to_string())?;
    let n = frame::body_len(len, max.min(MAX_FRAME)).map_err(|t| format!("a replication frame claims {} bytes (at most {} here): the peer is not a kvferry master of this version", t.len, t.max))?;
    let mut body = Vec::with_capacity(frame::PREFIX_LEN + n.min(1 << 20));
    body.extend_from_slice(&len);
    r.take(n as u64).read_to_end(&mut body).map_err(|e| e.to_string())?;
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

/// The in-sync set as etcd holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InSync {
    /// The term of the leader that wrote it (its members' mirrors come from that leader).
    pub term: i64,
    /// Member ids (standbys' RPC addresses).
    pub members: Vec<String>,
}

impl InSync {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// An absent or empty value is the empty set; anything unreadable is an error (a master
    /// must not guess who may lead).
    pub fn parse(v: &[u8]) -> Result<InSync, String> {
        if v.is_empty() {
            return Ok(InSync::default());
        }
        serde_json::from_slice(v).map_err(|e| format!("the in-sync record is not readable ({e}); delete it only if every master is stopped"))
    }
}

/// The word in a standby's [`registration`] that says it takes [`ToStandby::Base`] frames.
pub const RUNS: &str = "runs";

/// The word in a standby's [`registration`] that says it reads [`Change::Granted`] (a leader
/// grants space ahead to puts only while every standby it links says so: one of an earlier
/// version would not decode the entry).
pub const GRANTS: &str = "grants";

/// A standby's registration (the value of its [`standby_key`]): where leaders reach its
/// mirror, then the term of its complete mirror if it has one (`-` if not), then [`RUNS`]
/// (a leader sends [`ToStandby::Base`] only to a standby that says so: a standby of an
/// earlier version registers without it, and a leader of an earlier version reads the first
/// two words only). A member registered without a
/// complete mirror of the in-sync record's term (restarted since it was named) can never lead
/// from it, so it does not hold the others back ([`eligibility`]'s `alive`), and a leader
/// promotes into the in-sync set only a standby whose registration names its term (so that
/// every member of the record says so in etcd before the leader relies on it).
pub fn registration(addr: &str, mirror: Option<i64>) -> String {
    match mirror {
        Some(term) => format!("{addr} {term} {RUNS} {GRANTS}"),
        None => format!("{addr} - {RUNS} {GRANTS}"),
    }
}

/// A standby's [`registration`], read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration<'a> {
    pub addr: &'a str,
    /// The term of its complete mirror.
    pub mirror: Option<i64>,
    /// It takes [`ToStandby::Base`] frames.
    pub runs: bool,
    /// It reads [`Change::Granted`].
    pub grants: bool,
}

/// The address, mirror term and abilities of a [`registration`] (or of one an earlier
/// version wrote: `addr` or `addr term`).
pub fn parse_registration(v: &str) -> Registration<'_> {
    let mut words = v.split_whitespace();
    let addr = words.next().unwrap_or("");
    let mirror = words.next().and_then(|t| t.parse().ok());
    let rest: Vec<&str> = words.collect();
    Registration { addr, mirror, runs: rest.contains(&RUNS), grants: rest.contains(&GRANTS) }
}

/// What a master that finds no leader may do, given the in-sync record and its mirror.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Eligibility {
    /// The set is empty: the etcd journal holds everything acknowledged; load it.
    Journal,
    /// This master is a member with a complete mirror of the record's term: lead from it.
    Mirror,
    /// Members are named but none of them is registered with a complete mirror of the
    /// record's term any more (all dead, or restarted without it): lead, starting empty (what
    /// only they held is lost; a stale journal is never served).
    Empty,
    /// Another member is registered with a complete mirror of the record's term: only it may
    /// lead; wait.
    Wait,
}

/// The rule, pure: `me` this master's id, `mirror` the term of its complete mirror (if any),
/// `alive` whether a member is registered with a complete mirror of the record's term.
pub fn eligibility(rec: &InSync, me: &str, mirror: Option<i64>, alive: impl Fn(&str) -> bool) -> Eligibility {
    if rec.members.is_empty() {
        return Eligibility::Journal;
    }
    if rec.members.iter().any(|m| m == me) && mirror == Some(rec.term) {
        return Eligibility::Mirror;
    }
    if rec.members.iter().any(|m| m != me && alive(m)) {
        return Eligibility::Wait;
    }
    // Members are all gone, or this master is the only one left and its mirror does not
    // match (restarted since it was named): start empty.
    Eligibility::Empty
}

/// Whether a member that is stopping holds what the next leader needs: the record names it,
/// its mirror is complete and of the record's term, and no other member is registered with
/// such a mirror (`alive`). It then leaves its mirror in etcd before it exits (it takes over
/// once the leader's key is gone, and hands off like a leader that stops), unless the record
/// stops naming it first (a leader alive drops it from the set, writing etcd what the set
/// held). Otherwise it may simply go.
pub fn needed_at_stop(rec: &InSync, me: &str, mirror: Option<i64>, alive: impl Fn(&str) -> bool) -> bool {
    rec.members.iter().any(|m| m == me) && mirror == Some(rec.term) && !rec.members.iter().any(|m| m != me && alive(m))
}

// ---------------------------------------------------------------- standby side

/// What the connection that feeds a mirror has said: the protocol's state, and the entries
/// received and acknowledged but not applied yet.
#[derive(Default)]
struct Feed {
    /// The term of the leader it mirrors; connections of older terms are refused.
    term: i64,
    /// The connection that feeds it (others are ignored).
    conn: u64,
    next_conn: u64,
    /// The last entry received (decoded, in order) and so acknowledged.
    seq: u64,
    /// An image was received whole (and every entry since, in order).
    complete: bool,
    /// Taken over (this master leads from it): nothing more is applied.
    closed: bool,
    /// This master is stopping: its mirror is kept (for a takeover) but fed no more, so that a
    /// leader alive drops it from the in-sync set.
    sealed: bool,
    /// The socket of the connection that feeds it, shut down by [`Mirror::seal`] (an idle
    /// leader would otherwise learn only at its next entry that the standby left).
    sock: Option<TcpStream>,
    /// Received and acknowledged, with when they arrived, not applied to the image yet: the
    /// connection's thread applies them once it has acknowledged them, a takeover first
    /// ([`Mirror::take`]).
    pending: Vec<(Instant, Vec<Change>)>,
    /// The entries received since where the leader's etcd journal is whole, as they came
    /// ([`MirrorTail`]).
    tail: MirrorTail,
}

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
    Built { conn: u64, seq: u64, at: u64, state: Box<State>, rebuilt: Rebuilt },
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
    Built { state: Box<State>, rebuilt: Rebuilt, at: u64 },
}

/// A standby's copy of the leader's state, fed by [`serve`].
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
    auth: Option<kvferry::auth::ClusterKey>,
    /// This standby's member id (its RPC address): with the key, a leader dials
    /// [`standby_identity`] of it and the cluster.
    member: String,
    feed: Mutex<Feed>,
    /// The leader etcd names, as this standby last read it (its key's create revision and
    /// lease): only that leader may feed the mirror.
    leader: Mutex<Option<(i64, i64)>>,
    cluster_id: String,
    /// How long a held-back replica is kept (two read lease TTLs).
    keep_held: Duration,
    /// The bytes of entries' frames a run keeps for a takeover ([`MirrorTail`]; 0: none).
    tail_cap: usize,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
            feed: Mutex::new(Feed::default()),
            leader: Mutex::new(None),
            cluster_id: cluster_id.to_string(),
            keep_held: read_lease * 2,
            tail_cap,
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
            *p = Prebuild::Building { objects: image.objects() };
            (image, f.next_conn, f.seq)
        };
        let at = pb.clock.elapsed().as_millis() as u64;
        let t = Instant::now();
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| image.into_state(PREBUILT_TERM, at, pb.lease_ms)));
        let mut p = locked(&self.prebuilt);
        let f = locked(&self.feed);
        debug_assert!(matches!(*p, Prebuild::Building { .. }), "only the build's end replaces its marker");
        let stale;
        (*p, stale) = match built {
            Ok((state, rebuilt)) if f.next_conn == conn && f.seq == seq && !f.closed => {
                tracing::info!(seq, objects = rebuilt.objects, ms = t.elapsed().as_millis() as u64, "HA replication: the leader's feed ended; this standby's state is built ahead for a takeover");
                (Prebuild::Built { conn, seq, at, state: Box::new(state), rebuilt }, None)
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
            image.apply(Change::HeldUntil { replica, left: until.saturating_duration_since(now).as_millis() as u64 });
        }
        image
    }

    /// Drops a state built ahead (on a thread of its own: a million objects take a while); a
    /// build under way is left to end (it drops what it built, the mirror having changed).
    fn drop_prebuilt(p: &mut Prebuild) {
        match std::mem::take(p) {
            Prebuild::Built { state, .. } => {
                let _ = std::thread::Builder::new().name("kvf-ha-drop".into()).spawn(move || drop(state));
            }
            other => *p = other,
        }
    }

    /// Applies every pending change to the image.
    pub fn apply_pending(&self) {
        let mut a = locked(&self.applied);
        let pending = std::mem::take(&mut locked(&self.feed).pending);
        self.put_all(&mut a, pending);
        let now = Instant::now();
        while a.held.peek().is_some_and(|Reverse((until, _))| *until < now) {
            a.held.pop();
        }
    }

    fn put_all(&self, a: &mut Applied, pending: Vec<(Instant, Vec<Change>)>) {
        for (at, changes) in pending {
            for c in changes {
                match c {
                    Change::HeldBack { replica } => a.held.push(Reverse((at + self.keep_held, replica))),
                    // (At most a day: a real leader holds for its release timeout; a
                    // larger value would overflow the clock.)
                    Change::HeldUntil { replica, left } => a.held.push(Reverse((at + self.keep_held.max(Duration::from_millis(left.min(86_400_000))), replica))),
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
        MirrorStatus { term: f.term, seq: f.seq, complete: f.complete && !f.closed, fed: f.conn != 0 && !f.closed, sealed: f.sealed, pending_changes, objects, tail_bytes, tail_base }
    }

    /// The term of a complete mirror.
    pub fn complete_term(&self) -> Option<i64> {
        let f = locked(&self.feed);
        (f.complete && !f.closed).then_some(f.term)
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
            p = self.prebuilt_done.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        if !f.complete || f.closed || f.term != term {
            return None;
        }
        f.closed = true;
        f.complete = false;
        let tail = std::mem::take(&mut f.tail);
        if p.built_for(&f) {
            if let Prebuild::Built { state, rebuilt, at, .. } = std::mem::take(&mut *p) {
                return Some((Taken::Built { state, rebuilt, at }, f.seq, tail));
            }
        }
        Self::drop_prebuilt(&mut p);
        self.put_all(&mut a, std::mem::take(&mut f.pending));
        let image = Self::image_with_held(&mut a);
        Some((Taken::Image(image), f.seq, tail))
    }

    /// Feeds the mirror no more (this master is stopping) and ends the connection that fed
    /// it; what it holds stays, for [`Mirror::take`].
    pub fn seal(&self) {
        let mut f = locked(&self.feed);
        f.sealed = true;
        f.conn = 0;
        if let Some(sock) = f.sock.take() {
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The socket of connection `conn` (if it still feeds the mirror), for [`Mirror::seal`].
    fn attach(&self, conn: u64, sock: &TcpStream) {
        let mut f = locked(&self.feed);
        if f.conn == conn && !f.sealed {
            f.sock = sock.try_clone().ok();
        }
    }

    /// Connection `conn` ended: nothing feeds the mirror (until a leader says hello), and its
    /// copy of the socket is closed.
    fn detach(&self, conn: u64) {
        let mut f = locked(&self.feed);
        if f.conn == conn {
            f.conn = 0;
            f.sock = None;
        }
    }

    /// Puts back a mirror of `term` that [`Mirror::take`] handed to a takeover that failed (so
    /// this member can campaign from it again); no connection feeds it until a leader says
    /// hello.
    pub fn restore(&self, term: i64, image: Image, seq: u64, tail: MirrorTail) {
        Self::drop_prebuilt(&mut locked(&self.prebuilt));
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        *a = Applied { image, ..Applied::default() };
        *f = Feed { term, next_conn: f.next_conn, seq, complete: true, sealed: f.sealed, tail, ..Feed::default() };
    }

    /// This master leads: nothing is mirrored (what was is dropped) until [`Mirror::reopen`].
    pub fn close(&self) {
        Self::drop_prebuilt(&mut locked(&self.prebuilt));
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        *a = Applied::default();
        *f = Feed { term: f.term, next_conn: f.next_conn, closed: true, sealed: f.sealed, ..Feed::default() };
    }

    /// Accepts feeds again (after a campaign lost, or stepping down), of terms from the one it
    /// last mirrored.
    pub fn reopen(&self) {
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        if !f.closed {
            return;
        }
        *a = Applied::default();
        *f = Feed { term: f.term, next_conn: f.next_conn, sealed: f.sealed, ..Feed::default() };
    }

    /// The leader key this standby read (its create revision and lease), `None` when absent.
    pub fn set_leader(&self, owner: Option<(i64, i64)>) {
        *locked(&self.leader) = owner;
    }

    /// A connection said hello: it feeds the mirror from now on (an image follows), unless it
    /// is of another cluster or an older term. Its connection id.
    fn hello(&self, cluster_id: &str, term: i64, lease: i64) -> Result<u64, String> {
        if cluster_id != self.cluster_id {
            return Err(format!("this standby serves cluster {:?}, not {cluster_id:?}", self.cluster_id));
        }
        let named = *locked(&self.leader);
        if named != Some((term, lease)) {
            return Err(format!("term {term} (lease {lease:x}) is not the leader etcd names to this standby ({named:?}); a new leader is retried once this standby has read its key"));
        }
        let mut a = locked(&self.applied);
        let mut f = locked(&self.feed);
        if f.closed {
            return Err("this master is taking over or leads".into());
        }
        if f.sealed {
            return Err("this standby is stopping".into());
        }
        if term < f.term {
            return Err(format!("term {term} is older than the term {} this standby follows", f.term));
        }
        let conn = f.next_conn + 1;
        *a = Applied::default();
        *f = Feed { term, conn, next_conn: conn, ..Feed::default() };
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
    fn take_frame(&self, conn: u64, frame: ToStandby, raw: Vec<u8>) -> Result<Option<u64>, String> {
        let mut f = locked(&self.feed);
        if f.conn != conn || f.closed {
            return Err("another leader's connection replaced this one".into());
        }
        let (ack, changes) = match frame {
            ToStandby::Hello { .. } => return Err("a second hello on one connection".into()),
            ToStandby::AuthHello { .. } | ToStandby::AuthProof { .. } => return Err("an authentication step after the hello".into()),
            ToStandby::Image { seq, changes, last } => {
                if f.complete {
                    return Err("an image after the image".into());
                }
                if last {
                    f.seq = seq;
                    f.complete = true;
                }
                (last.then_some(seq), changes)
            }
            ToStandby::Entry { seq, changes } => {
                if !f.complete || seq <= f.seq {
                    return Err(format!("entry {seq} out of order (mirror at {}, complete: {})", f.seq, f.complete));
                }
                let first = f.seq + 1;
                f.tail.push(first, seq, raw, self.tail_cap);
                f.seq = seq;
                (Some(seq), changes)
            }
            ToStandby::Base { seq, written } => {
                if f.complete {
                    let at = f.seq;
                    f.tail.base(seq, written, at, self.tail_cap);
                }
                (None, Vec::new())
            }
            ToStandby::Run { base, frames } => {
                if f.complete {
                    let at = f.seq;
                    f.tail.joined(base, frames, at, self.tail_cap);
                }
                (None, Vec::new())
            }
        };
        if !changes.is_empty() {
            f.pending.push((Instant::now(), changes));
        }
        Ok(ack)
    }
}

/// Serves the replication port of a standby: each connection (a leader) feeds `mirror`.
/// Runs until the process ends.
/// With the cluster key, at most [`MAX_UNPROVED_LINKS`] connections that did not prove it yet
/// are kept (more are closed at accept), each for at most [`PROOF_DEADLINE`].
pub fn serve(listener: TcpListener, mirror: Arc<Mirror>) {
    let unproved = crate::net::Unproved::new("HA replication", MAX_UNPROVED_LINKS.0, MAX_UNPROVED_LINKS.1, PROOF_DEADLINE);
    for conn in listener.incoming() {
        let Some(s) = crate::net::accepted(conn, "HA replication: accepting a leader's connection") else { continue };
        let Ok(slot) = unproved.place(mirror.auth.is_some(), &s) else { continue };
        let m = Arc::clone(&mirror);
        let _ = std::thread::Builder::new().name("kvf-ha-standby".into()).spawn(move || {
            if let Err(e) = follow(s, &m, slot) {
                tracing::debug!("HA replication: a leader's connection ended: {e}");
            }
        });
    }
}

/// What a leader's connection proved: its `Hello`, and with the cluster key the halves of
/// the link's session.
type Accepted = (ToStandby, Incoming, Option<kvferry::auth::Sealer>);

/// The standby's side of a new connection, within `deadline`: without a cluster key, its
/// first frame (the leader's `Hello`, at most [`MAX_SMALL_FRAME`]); with one, the key's
/// handshake ([`prove_to_standby`]: the opening message in a plain frame whose length prefix
/// over [`MAX_AUTH_HELLO_FRAME`] is refused before anything more is read, read into a fixed
/// buffer, dialing `identity`), then the first sealed frame, which must open under the session
/// (only a leader holding it can seal one) and is the `Hello`. The error says why the
/// connection is refused (sent to the leader as [`ToLeader::Refused`] by the caller, sealed
/// with the sealer returned when the session exists).
fn accept_leader(s: &mut TcpStream, key: Option<&kvferry::auth::ClusterKey>, identity: &str, deadline: Instant) -> Result<Accepted, (String, Option<kvferry::auth::Sealer>)> {
    use crate::net::read_by;
    use kvferry::auth::FRAME_HEAD_LEN;
    let Some(key) = key else {
        s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))).map_err(|e| (e.to_string(), None))?;
        return match read_frame_max(s, MAX_SMALL_FRAME).map_err(|e| (e, None))? {
            ToStandby::AuthHello { .. } => Err(("this standby has no cluster key (KVFERRY_AUTH_KEY_FILE is unset where it runs): give it the cluster's key file, or unset it on the leader".into(), None)),
            first => Ok((first, Incoming::Plain, None)),
        };
    };
    let io = |e: std::io::Error| (e.to_string(), None);
    let needs = "this standby requires the cluster key: set KVFERRY_AUTH_KEY_FILE on the leader to the cluster's key file";
    let mut prefix = [0u8; frame::PREFIX_LEN];
    read_by(s, &mut prefix, deadline).map_err(io)?;
    let n = frame::body_len(prefix, MAX_AUTH_HELLO_FRAME).map_err(|t| (format!("{needs} (its first frame claims {} bytes; the key's handshake is at most {MAX_AUTH_HELLO_FRAME})", t.len), None))?;
    let mut first = [0u8; MAX_AUTH_HELLO_FRAME];
    read_by(s, &mut first[..n], deadline).map_err(io)?;
    let Some(hello) = crate::proto::bytes_variant(&first[..n], AUTH_HELLO) else { return Err((needs.into(), None)) };
    let (session, answer) = kvferry::auth::answer(key, HA_LINK, hello, &[identity]).map_err(|r| (format!("the leader's hello: {r}"), None))?;
    s.set_write_timeout(Some(PROOF_DEADLINE)).map_err(io)?;
    s.write_all(&encode_frame(&ToLeader::AuthChallenge { answer }).map_err(|e| (e, None))?).map_err(io)?;
    let (sealer, opener) = session.split();
    let mut head = [0u8; FRAME_HEAD_LEN];
    let fail = |why: String, sealer| Err((why, Some(sealer)));
    if let Err(e) = read_by(s, &mut head, deadline) {
        return fail(e.to_string(), sealer);
    }
    let mut inc = Incoming::Sealed { opener, next: None };
    let Incoming::Sealed { opener, next } = &mut inc else { unreachable!("just made sealed") };
    match opener.open_frame_head(&head, MAX_SMALL_FRAME) {
        Ok(n) => *next = Some(n),
        Err(r) => return fail(format!("the leader's first frame after the handshake: {r}"), sealer),
    }
    // (The head opened: the leader holds the session. Its hello is read by the deadline.)
    if let Err(e) = s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))) {
        return fail(e.to_string(), sealer);
    }
    match read_frame_in::<ToStandby>(s, &mut inc, MAX_SMALL_FRAME) {
        Ok((hello, _)) => Ok((hello, inc, Some(sealer))),
        Err(e) => fail(format!("the leader's first frame after the handshake: {e}"), sealer),
    }
}

/// The leader's side of the cluster key's handshake on a new link, before its `Hello`: it
/// dials `identity` ([`standby_identity`]) and links only a standby that answers under the
/// key; the session's halves.
fn prove_to_standby(s: &mut TcpStream, key: &kvferry::auth::ClusterKey, identity: &str) -> Result<(kvferry::auth::Sealer, kvferry::auth::Opener), String> {
    let (init, hello) = kvferry::auth::Initiator::new(key, HA_LINK, identity).map_err(|r| format!("dialing {identity:?}: {r}"))?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(|e| e.to_string())?;
    s.write_all(&encode_frame(&ToStandby::AuthHello { hello })?).map_err(|e| format!("authenticating: {e}"))?;
    let couldnt = "it and this leader could not prove the cluster key to each other";
    match read_frame_max::<ToLeader>(s, MAX_SMALL_FRAME).map_err(|e| format!("authenticating: {e}"))? {
        ToLeader::AuthChallenge { answer } => {
            let session = init.finish(&answer).map_err(|r| format!("{couldnt}: its answer: {r}"))?;
            s.set_read_timeout(None).map_err(|e| e.to_string())?;
            Ok(session.split())
        }
        ToLeader::Refused { why } => Err(format!("{couldnt}: it refused the link: {why}")),
        other => Err(format!("it answered {other:?} to the cluster key's handshake")),
    }
}

fn follow(mut s: TcpStream, m: &Mirror, unproved: Option<crate::net::UnprovedSlot>) -> Result<(), String> {
    let _ = s.set_nodelay(true);
    // A leader says hello at once; a silent peer is not a leader.
    let deadline = Instant::now() + PROOF_DEADLINE;
    let (hello, inc, mut sealer) = match accept_leader(&mut s, m.auth.as_ref(), &standby_identity(&m.cluster_id, &m.member), deadline) {
        Ok(a) => a,
        Err((why, mut sealer)) => {
            let _ = s.write_all(&wire(sealer.as_mut(), &encode_frame(&ToLeader::Refused { why: why.clone() })?));
            return Err(why);
        }
    };
    drop(unproved);
    let ToStandby::Hello { cluster_id, term, lease, leader } = hello else {
        let why = "the first frame is not a hello".to_string();
        let _ = s.write_all(&wire(sealer.as_mut(), &encode_frame(&ToLeader::Refused { why: why.clone() })?));
        return Err(why);
    };
    let conn = match m.hello(&cluster_id, term, lease) {
        Ok(c) => c,
        Err(why) => {
            let _ = s.write_all(&wire(sealer.as_mut(), &encode_frame(&ToLeader::Refused { why: why.clone() })?));
            return Err(why);
        }
    };
    tracing::info!(term, "HA replication: following the leader at {leader}");
    m.attach(conn, &s);
    let ended = entries(s, m, conn, inc, sealer);
    // (The mirror's copy of the socket would keep the connection open.)
    m.detach(conn);
    // Nothing feeds the mirror: if the leader died, this member may take over once its lease
    // runs out; the state is built meanwhile.
    m.prebuild();
    ended
}

/// Takes the entries of connection `conn` until it ends.
fn entries(mut s: TcpStream, m: &Mirror, conn: u64, mut inc: Incoming, mut sealer: Option<kvferry::auth::Sealer>) -> Result<(), String> {
    // Entries come as the leader writes them; an idle leader sends nothing for a while. A
    // leader whose host died without closing the connection is found by TCP keepalive (idle
    // 10 s, then 3 probes 5 s apart), so this thread and its buffer do not wait forever.
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    crate::net::keepalive(&s, Duration::from_secs(10));
    let mut r = std::io::BufReader::with_capacity(1 << 20, s.try_clone().map_err(|e| e.to_string())?);
    let spin = crate::net::Spin::for_replication();
    // The last entry taken and not acknowledged yet.
    let mut unacked = None;
    loop {
        if r.buffer().is_empty() {
            spin.readable(&s);
        }
        let (f, raw) = read_frame_in::<ToStandby>(&mut r, &mut inc, MAX_FRAME)?;
        match m.take_frame(conn, f, raw) {
            // One acknowledgement for the entries that came together: while another whole
            // frame is already read, it is taken first (acknowledgements are cumulative; a
            // frame that acknowledges nothing, such as a `Base`, keeps what one before it
            // would). Acknowledged before they are applied (held in memory, checked to be
            // the next ones): the leader's wait is the network's, not the map's.
            Ok(ack) => {
                unacked = ack.or(unacked);
                if !whole_in(&mut r, &mut inc)? {
                    if let Some(seq) = unacked.take() {
                        s.write_all(&wire(sealer.as_mut(), &encode_frame(&ToLeader::Ack { seq })?)).map_err(|e| e.to_string())?;
                    }
                    m.apply_pending();
                }
            }
            Err(why) => {
                let _ = s.write_all(&wire(sealer.as_mut(), &encode_frame(&ToLeader::Refused { why: why.clone() })?));
                return Err(why);
            }
        }
    }
}

// ---------------------------------------------------------------- leader side

/// What a link tells the leader's side as it happens (called from the link's threads).
pub trait AckSink: Send + Sync {
    /// The standby acknowledged more entries (its [`Link::acked`] grew).
    fn acked(&self);
    /// The link broke (its [`Link::dead`] is true).
    fn broke(&self);
}

/// The leader's connection to one standby: frames go out through a channel to its sender
/// thread (which connects first, so the leader's writer never waits on a slow or unreachable
/// standby); a reader thread records acknowledgements.
pub struct Link {
    pub member: String,
    pub addr: String,
    tx: Option<std::sync::mpsc::Sender<Queued>>,
    acked: Arc<AtomicU64>,
    dead: Arc<AtomicBool>,
    /// Bytes queued and not yet written: a standby that does not read (paused, overloaded)
    /// is cut off past [`Link::backlog_limit`] instead of growing the leader's memory.
    queued: Arc<AtomicU64>,
    /// The entry its image ends at (it is in sync once it acknowledged the last entry
    /// written, which is at least this).
    pub image_seq: u64,
    image_bytes: u64,
    sock: Arc<Mutex<Option<TcpStream>>>,
    /// With the cluster key, seals every frame of the link (the `Hello` first) right before
    /// it is written, by whichever of [`Link::send`] or the sender thread writes it: their
    /// writes never overlap, so the sequence numbers follow the wire.
    sealer: Arc<Mutex<Option<kvferry::auth::Sealer>>>,
    /// Whether the link is sealed (the cluster key is held).
    sealed: bool,
    /// It takes [`ToStandby::Base`] frames (its [`registration`] says so).
    pub runs: bool,
    /// It reads [`Change::Granted`] (its [`registration`] says so).
    pub grants: bool,
}

/// A frame queued for a link's sender thread: to be sealed as it is written (`seal`), or its
/// bytes as they go out.
struct Queued {
    bytes: Arc<Vec<u8>>,
    seal: bool,
}

/// How long connecting to a standby may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A write to a standby that takes longer than this ends its link.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

impl Link {
    /// Starts linking to `addr`: its sender thread connects, says `hello`, then sends what is
    /// queued; its reader thread records acknowledgements. Never blocks the caller on the
    /// network.
    /// With the cluster key (`auth`), the sender thread first runs the key's handshake,
    /// dialing the standby's [`standby_identity`] (`member` of `hello`'s cluster), and every
    /// frame after is sealed.
    pub fn open(member: &str, addr: &str, hello: &ToStandby, auth: Option<kvferry::auth::ClusterKey>, signal: Arc<dyn AckSink>) -> Result<Link, String> {
        let sa: std::net::SocketAddr = addr.parse().map_err(|e| format!("the standby {member} announced {addr:?}, not an address: {e}"))?;
        let ToStandby::Hello { cluster_id, .. } = hello else { return Err("a link opens with a hello".into()) };
        let identity = standby_identity(cluster_id, member);
        let hello = encode_frame(hello)?;
        let (tx, rx) = std::sync::mpsc::channel::<Queued>();
        let acked = Arc::new(AtomicU64::new(0));
        let dead = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicU64::new(0));
        let sock: Arc<Mutex<Option<TcpStream>>> = Arc::default();
        let sealer: Arc<Mutex<Option<kvferry::auth::Sealer>>> = Arc::default();
        let sealed = auth.is_some();
        let (dead2, signal2, acked2, queued2, sock2, sealer2) = (Arc::clone(&dead), signal, Arc::clone(&acked), Arc::clone(&queued), Arc::clone(&sock), Arc::clone(&sealer));
        let m = member.to_string();
        std::thread::Builder::new()
            .name("kvf-ha-send".into())
            .spawn(move || {
                let end = |why: String| {
                    tracing::warn!("HA replication: the standby {m}: {why}");
                    dead2.store(true, Ordering::Release);
                    signal2.broke();
                };
                let mut w = match TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT) {
                    Ok(s) => s,
                    Err(e) => return end(format!("connecting to {sa}: {e}")),
                };
                let _ = w.set_nodelay(true);
                let _ = w.set_write_timeout(Some(WRITE_TIMEOUT));
                let mut inc = Incoming::Plain;
                if let Some(key) = &auth {
                    match prove_to_standby(&mut w, key, &identity) {
                        Ok((s, o)) => {
                            *locked(&sealer2) = Some(s);
                            inc = Incoming::sealed(o);
                        }
                        Err(e) => return end(e),
                    }
                }
                // What goes on the wire for `f`: sealed here when it is queued to be.
                let wire_of = |f: Queued| match f {
                    Queued { bytes, seal: true } => Arc::new(wire(locked(&sealer2).as_mut(), &bytes)),
                    Queued { bytes, seal: false } => bytes,
                };
                let r = match w.try_clone() {
                    Ok(r) => r,
                    Err(e) => return end(e.to_string()),
                };
                let (dead3, signal3, m3) = (Arc::clone(&dead2), Arc::clone(&signal2), m.clone());
                let reader = std::thread::Builder::new().name("kvf-ha-acks".into()).spawn(move || {
                    let mut r = std::io::BufReader::new(r);
                    let spin = crate::net::Spin::for_replication();
                    loop {
                        if r.buffer().is_empty() {
                            spin.readable(r.get_ref());
                        }
                        match read_frame_in::<ToLeader>(&mut r, &mut inc, MAX_SMALL_FRAME).map(|(f, _)| f) {
                            Ok(ToLeader::Ack { seq }) => {
                                acked2.fetch_max(seq, Ordering::AcqRel);
                                signal3.acked();
                            }
                            Ok(ToLeader::Refused { why }) => {
                                tracing::warn!("HA replication: the standby {m3} refused: {why}");
                                break;
                            }
                            Ok(ToLeader::AuthChallenge { .. }) => {
                                tracing::warn!("HA replication: the standby {m3} sent a handshake's answer after the handshake");
                                break;
                            }
                            Err(e) => {
                                tracing::debug!("HA replication: the standby {m3}'s connection ended: {e}");
                                break;
                            }
                        }
                    }
                    dead3.store(true, Ordering::Release);
                    signal3.broke();
                });
                if let Err(e) = reader {
                    return end(e.to_string());
                }
                if let Err(e) = w.write_all(&wire_of(Queued { bytes: Arc::new(hello), seal: sealed })) {
                    return end(format!("greeting: {e}"));
                }
                // From now on the writer may write entries itself while nothing is queued.
                match (w.try_clone(), sock2.lock()) {
                    (Ok(s), Ok(mut g)) => *g = Some(s),
                    _ => return end("cannot keep the connection".into()),
                }
                while let Ok(f) = rx.recv() {
                    let n = f.bytes.len() as u64;
                    if let Err(e) = w.write_all(&wire_of(f)) {
                        return end(format!("sending: {e}"));
                    }
                    queued2.fetch_sub(n, Ordering::AcqRel);
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
                dead2.store(true, Ordering::Release);
                signal2.broke();
            })
            .map_err(|e| e.to_string())?;
        Ok(Link { member: member.to_string(), addr: addr.to_string(), tx: Some(tx), acked, dead, queued, image_seq: 0, image_bytes: 0, sock, sealer, sealed, runs: false, grants: false })
    }

    /// The most a link may have queued: its image and 256 MiB more, or twice its image.
    fn backlog_limit(&self) -> u64 {
        (self.image_bytes + (256 << 20)).max(2 * self.image_bytes)
    }

    /// Sends a frame: written at once when nothing is queued and the socket takes it whole
    /// without blocking (the common case: no hop through the sender thread), else queued
    /// (what was not written of it, in order). False when the link is gone (or cut off: too
    /// much queued). Frames come from one sender at a time (the leader's writer, or a request
    /// thread it lent its links to, under the journal queue's lock: see `journal::Lent`), so
    /// with nothing queued the sender thread is idle and writing here keeps the order.
    ///
    /// On a sealed link a frame is sealed as it is written here, or queued to be sealed by
    /// the sender thread as it writes it; once sealed, its bytes are what goes out (what was
    /// not written of them is queued as they are).
    pub fn send(&self, frame: &Arc<Vec<u8>>) -> bool {
        if self.dead() {
            return false;
        }
        if self.queued.load(Ordering::Acquire) == 0 {
            let g = self.sock.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(sock) = g.as_ref() {
                let bytes = if self.sealed { Arc::new(wire(locked(&self.sealer).as_mut(), frame)) } else { Arc::clone(frame) };
                match rustix::net::send(sock, &bytes, rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL) {
                    Ok(n) if n == bytes.len() => return true,
                    Ok(n) => {
                        drop(g);
                        return self.enqueue(Queued { bytes: Arc::new(bytes[n..].to_vec()), seal: false });
                    }
                    Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {
                        drop(g);
                        return self.enqueue(Queued { bytes, seal: false });
                    }
                    Err(e) => {
                        drop(g);
                        tracing::warn!("HA replication: sending to the standby {}: {e}", self.member);
                        self.cut();
                        return false;
                    }
                }
            }
        }
        self.enqueue(Queued { bytes: Arc::clone(frame), seal: self.sealed })
    }

    fn enqueue(&self, f: Queued) -> bool {
        let n = f.bytes.len() as u64;
        let q = self.queued.fetch_add(n, Ordering::AcqRel) + n;
        if q > self.backlog_limit() {
            tracing::warn!("HA replication: the standby {} does not keep up ({q} bytes queued); its link is cut", self.member);
            self.cut();
            return false;
        }
        self.tx.as_ref().is_some_and(|tx| tx.send(f).is_ok())
    }

    /// Queues an image's frames.
    pub fn send_image(&mut self, seq: u64, frames: &[Arc<Vec<u8>>]) {
        self.image_seq = seq;
        self.image_bytes = frames.iter().map(|f| f.len() as u64).sum();
        for f in frames {
            self.send(f);
        }
    }

    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::Acquire)
    }

    /// The counter behind [`Link::acked`], for whoever releases entries as it grows.
    pub fn ack_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.acked)
    }

    pub fn dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn cut(&self) {
        self.dead.store(true, Ordering::Release);
        if let Some(s) = self.sock.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.tx = None; // the sender thread ends once it drained the channel
        self.cut(); // or at once, if it is stuck writing; the reader ends too
    }
}

/// The image frames of `changes` (the state after entry `seq`), calling `between` between
/// two frames whenever `hold` of encoding passed since the last call (a leader commits what
/// requests queued meanwhile, [`IMAGE_ENCODE_HOLD`]: a million objects take 0.1-0.2 s to
/// encode); `between` returning false gives the image up (an error).
pub fn image_frames(seq: u64, changes: Vec<Change>, hold: Duration, between: impl FnMut() -> bool) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut it = changes.into_iter().peekable();
    let mut done = false;
    let frames = std::iter::from_fn(|| {
        if done {
            return None;
        }
        let changes: Vec<Change> = it.by_ref().take(IMAGE_PIECE).collect();
        done = it.peek().is_none();
        Some(ToStandby::Image { seq, changes, last: done })
    });
    encode_between(frames, hold, between)
}

/// The [`ToStandby::Run`] frames of the run from `base` (`frames`, consecutive), each of at
/// most about [`RUN_PIECE`] bytes (one frame at least), calling `between` as
/// [`image_frames`] does.
pub fn run_frames(base: u64, frames: &[TailFrame], hold: Duration, between: impl FnMut() -> bool) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut rest = frames;
    let pieces = std::iter::from_fn(|| {
        if rest.is_empty() {
            return None;
        }
        let (mut n, mut bytes) = (0, 0);
        for f in rest {
            if n > 0 && bytes + f.frame.len() > RUN_PIECE {
                break;
            }
            (n, bytes) = (n + 1, bytes + f.frame.len());
        }
        let (piece, after) = rest.split_at(n);
        rest = after;
        let kept = piece.iter().map(|f| KeptFrame { first: f.first, last: f.last, frame: bytes::Bytes::copy_from_slice(&f.frame) }).collect();
        Some(ToStandby::Run { base, frames: kept })
    });
    encode_between(pieces, hold, between)
}

/// Encodes `frames`, calling `between` between two of them whenever `hold` of encoding passed
/// since the last call; `between` returning false gives up (an error).
fn encode_between(frames: impl Iterator<Item = ToStandby>, hold: Duration, mut between: impl FnMut() -> bool) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut out = Vec::new();
    let mut since = Instant::now();
    let mut frames = frames.peekable();
    while let Some(f) = frames.next() {
        out.push(Arc::new(encode_frame(&f)?));
        if frames.peek().is_some() && since.elapsed() >= hold {
            if !between() {
                return Err("given up by the leader's writer (its term ended)".into());
            }
            since = Instant::now();
        }
    }
    Ok(out)
}

/// About the most bytes of entries one [`ToStandby::Run`] frame carries.
pub const RUN_PIECE: usize = 4 << 20;

/// How long a leader encodes a linking standby's image ([`image_frames`]) before it commits
/// what requests queued meanwhile.
pub const IMAGE_ENCODE_HOLD: Duration = Duration::from_millis(5);

#[cfg(test)]
mod tests {
    use super::*;
    impl Mirror {
        /// [`Mirror::take`] of a mirror that built nothing ahead.
        fn take_image(&self, term: i64) -> Option<(Image, u64, MirrorTail)> {
            self.take(term).map(|(t, seq, tail)| match t {
                Taken::Image(image) => (image, seq, tail),
                Taken::Built { .. } => panic!("a state built ahead"),
            })
        }
    }

    fn seg1() -> Change {
        Change::Mount { client: 7, seg: crate::proto::Segment { id: 1, name: "s1".into(), te_endpoint: "127.0.0.1:1".into(), base: 0, size: 1 << 20 } }
    }

    fn obj_at(key: &str, addr: u64) -> Change {
        Change::Object { key: key.into(), rec: ObjectRec { size: 100, current: smallvec::smallvec![(1, addr, 100)], pending: None, owner: 7, hard_pin: false, soft_pin_left: 0, group: None } }
    }

    /// A mirror whose feed ended builds the master's state ahead (not while fed), and a
    /// takeover gets that state, with every object; a leader that links again replaces the
    /// mirror, and the state built from the old one is not used.
    #[test]
    fn a_mirror_whose_feed_ended_builds_the_state_ahead_for_a_takeover() {
        let m = Mirror::new("c", Duration::from_secs(5), 1 << 20).with_prebuilder(Prebuilder { clock: Instant::now(), lease_ms: 1000 });
        m.set_leader(Some((5, 50)));
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 3, changes: vec![seg1(), obj_at("a", 0), obj_at("b", 4096)], last: true }).unwrap();
        m.apply(c, ToStandby::Base { seq: 3, written: true }).unwrap();
        m.apply(c, ToStandby::Entry { seq: 4, changes: vec![obj_at("c", 8192)] }).unwrap();
        m.prebuild();
        assert!(matches!(*locked(&m.prebuilt), Prebuild::None), "nothing is built while the leader feeds the mirror");
        m.detach(c);
        m.prebuild();
        assert!(matches!(*locked(&m.prebuilt), Prebuild::Built { seq: 4, .. }));
        assert_eq!((m.status().objects, m.complete_term()), (3, Some(5)), "the mirror still says what it holds, and may lead");
        match m.take(5) {
            Some((Taken::Built { state, rebuilt, .. }, 4, tail)) => {
                assert_eq!((rebuilt.objects, state.summary().keys, tail.after(3, 4).map(|t| t.len())), (3, 3, Some(1)));
            }
            _ => panic!("the state built ahead"),
        }
        // Built again, then the leader links again: a new image replaces the mirror and the
        // state built from the old one.
        m.reopen();
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 9, changes: vec![seg1(), obj_at("a", 0)], last: true }).unwrap();
        m.detach(c);
        m.prebuild();
        assert!(matches!(*locked(&m.prebuilt), Prebuild::Built { seq: 9, .. }));
        m.hello("c", 5, 50).unwrap();
        assert!(matches!(*locked(&m.prebuilt), Prebuild::None), "a hello drops it");
        // A build under way is left to its end (which sees the hello and drops what it built):
        // cleared before it ends, a second build could start and a takeover not wait for it,
        // taking the image-less mirror.
        *locked(&m.prebuilt) = Prebuild::Building { objects: 1 };
        m.hello("c", 5, 50).unwrap();
        m.close();
        m.reopen();
        assert!(matches!(*locked(&m.prebuilt), Prebuild::Building { .. }), "only the build's end replaces its marker");
        *locked(&m.prebuilt) = Prebuild::None;
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 12, changes: vec![seg1(), obj_at("x", 0), obj_at("y", 4096)], last: true }).unwrap();
        m.apply_pending();
        let (image, seq, _) = m.take_image(5).expect("complete");
        assert_eq!((image.objects(), seq), (2, 12));
    }
    use crate::master::journal::ObjectRec;
    use proptest::prelude::*;

    fn obj(key: &str, size: u64) -> Change {
        Change::Object { key: key.into(), rec: ObjectRec { size, current: smallvec::smallvec![(1, 4096, size)], pending: None, owner: 7, hard_pin: false, soft_pin_left: 0, group: None } }
    }

    #[test]
    fn frames_round_trip_and_partial_input_waits() {
        let f = ToStandby::Entry { seq: 9, changes: vec![obj("a", 10), Change::Forget { key: "b".into() }] };
        let bytes = encode_frame(&f).unwrap();
        for cut in 0..bytes.len() {
            assert_eq!(decode_frame::<ToStandby>(&bytes[..cut]).unwrap(), None, "{cut} bytes are not a frame yet");
            assert!(!frame::whole(&bytes[..cut]), "a standby acknowledges rather than wait for the rest of a frame");
        }
        assert!(frame::whole(&bytes), "another whole frame is read: applied before acknowledging");
        let mut two = bytes.clone();
        two.extend(encode_frame(&ToLeader::Ack { seq: 3 }).unwrap());
        assert_eq!(decode_frame::<ToStandby>(&two).unwrap(), Some((f.clone(), bytes.len())));
        assert_eq!(decode_frame::<ToLeader>(&two[bytes.len()..]).unwrap().map(|x| x.0), Some(ToLeader::Ack { seq: 3 }));
        assert_eq!(read_frame::<ToStandby>(&mut &bytes[..]).unwrap(), f);
        assert!(read_frame::<ToStandby>(&mut &bytes[..bytes.len() - 1]).is_err(), "a frame cut short is an error");
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(decode_frame::<ToStandby>(&huge).unwrap_err().contains("claims"), "an oversized length is refused before any allocation");
        // A hello (read from anyone who connects) or an acknowledgement claiming more than a
        // small frame is refused; a large claim followed by nothing is an error, not a
        // reservation of what it claims.
        let big = ((MAX_SMALL_FRAME + 1) as u32).to_le_bytes();
        assert!(read_frame_max::<ToStandby>(&mut &big[..], MAX_SMALL_FRAME).unwrap_err().contains("claims"));
        let claim = ((MAX_FRAME - 1) as u32).to_le_bytes();
        assert!(read_frame::<ToStandby>(&mut &claim[..]).unwrap_err().contains("cut short"));
    }

    /// The link's wire bytes, pinned: the length prefix (u32 little-endian), then the postcard
    /// body.
    #[test]
    fn frames_keep_their_wire_bytes() {
        let hello = ToStandby::Hello { cluster_id: "c".into(), term: 1, lease: 2, leader: "l".into() };
        assert_eq!(encode_frame(&hello).unwrap(), [7, 0, 0, 0, 0, 1, b'c', 2, 4, 1, b'l']);
        assert_eq!(encode_frame(&ToStandby::Base { seq: 9, written: true }).unwrap(), [3, 0, 0, 0, 3, 9, 1]);
        assert_eq!(encode_frame(&ToLeader::Ack { seq: 300 }).unwrap(), [3, 0, 0, 0, 0, 0xac, 0x02]);
        assert_eq!(decode_frame::<ToLeader>(&[3, 0, 0, 0, 0, 0xac, 0x02, 9]).unwrap(), Some((ToLeader::Ack { seq: 300 }, 7)));
        assert_eq!(read_frame::<ToStandby>(&mut &[7, 0, 0, 0, 0, 1, b'c', 2, 4, 1, b'l'][..]).unwrap(), hello);
    }

    proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_frame::<ToStandby>(&b);
            let _ = decode_frame::<ToLeader>(&b);
            let _ = read_frame::<ToStandby>(&mut &b[..]);
        }
    }

    #[test]
    fn a_mirror_applies_an_image_then_entries_in_order_from_its_newest_leader_only() {
        let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
        m.set_leader(Some((5, 50)));
        assert!(m.hello("other", 5, 50).is_err(), "another cluster's leader is refused");
        assert!(m.hello("c", 5, 51).is_err(), "a master etcd does not name (another lease) is refused");
        assert!(m.hello("c", 6, 50).is_err(), "a master etcd does not name (another term) is refused");
        let c1 = m.hello("c", 5, 50).unwrap();
        assert!(m.apply(c1, ToStandby::Entry { seq: 1, changes: vec![] }).is_err(), "an entry before the image is refused");
        let c1 = m.hello("c", 5, 50).unwrap();
        assert_eq!(m.apply(c1, ToStandby::Image { seq: 4, changes: vec![obj("a", 1)], last: false }).unwrap(), None);
        assert_eq!(m.complete_term(), None, "an image in progress is not a mirror to lead from");
        assert_eq!(m.apply(c1, ToStandby::Image { seq: 4, changes: vec![obj("b", 2)], last: true }).unwrap(), Some(4));
        assert_eq!(m.complete_term(), Some(5));
        assert_eq!(m.apply(c1, ToStandby::Base { seq: 4, written: true }).unwrap(), None, "a run's start acknowledges nothing");
        assert_eq!(m.status().pending_changes, 2, "acknowledged (held) before it is applied");
        m.apply_pending();
        assert_eq!(m.status().pending_changes, 0);
        assert!(m.hello("c", 5, 99).is_err(), "a stranger's hello is refused ...");
        assert_eq!(m.complete_term(), Some(5), "... and leaves the mirror and its feed as they were");
        assert_eq!(m.apply(c1, ToStandby::Entry { seq: 6, changes: vec![Change::Forget { key: "a".into() }, obj("c", 3), obj("d", 4)] }).unwrap(), Some(6));
        assert!(m.apply(c1, ToStandby::Entry { seq: 6, changes: vec![] }).is_err(), "an entry again is out of order");
        assert_eq!(m.status().pending_changes, 3, "the entry's changes are held, not applied: the takeover applies them");
        m.set_leader(Some((4, 40)));
        assert!(m.hello("c", 4, 40).is_err(), "an older term's leader (a deposed one) is refused");
        let (image, seq, tail) = m.take_image(5).expect("a complete mirror of term 5");
        assert_eq!((image.objects(), seq), (3, 6), "b, c and d: the image and the entry applied");
        assert_eq!(tail.after(4, 6).map(|t| t.iter().map(|f| (f.first, f.last)).collect::<Vec<_>>()), Some(vec![(5, 6)]), "the entry as it came, standing for the log's entries after the run's start");
        assert!(m.take_image(5).is_none(), "taken once");
        m.set_leader(Some((9, 90)));
        assert!(m.hello("c", 9, 90).is_err(), "a mirror taken over accepts nothing");
        m.reopen();
        assert!(m.hello("c", 4, 40).is_err());
        let c9 = m.hello("c", 9, 90).unwrap();
        assert!(m.apply(c1, ToStandby::Entry { seq: 7, changes: vec![] }).is_err(), "the replaced connection feeds nothing");
        assert_eq!(m.apply(c9, ToStandby::Image { seq: 7, changes: vec![], last: true }).unwrap(), Some(7));
        assert!(m.take_image(5).is_none(), "a mirror of term 9 is not one of term 5");
        // A takeover that failed puts its mirror back: complete, of the record's term, fed by
        // nobody until a leader says hello.
        let (image, seq, tail) = m.take_image(9).expect("complete");
        m.restore(9, image, seq, tail);
        assert_eq!(m.complete_term(), Some(9));
        assert!(m.apply(c9, ToStandby::Entry { seq: 8, changes: vec![] }).is_err(), "the old connection no longer feeds it");
        assert_eq!(m.take_image(9).map(|(i, s, t)| (i.objects(), s, t.bytes())), Some((0, 7, 0)));
    }

    /// A mirror keeps the entries after where the leader says its etcd journal is whole, as
    /// they came, for a takeover to write to that journal after where it ends: exactly the
    /// frames after that position when a run reaches back to it, none when none does, or when
    /// the journal ends inside a frame (several log entries streamed as one). A run that
    /// would pass the cap is dropped and nothing is kept until the next start; a background
    /// snapshot's start keeps the current run until its head is written; at most two runs. A
    /// new leader's feed starts them again; a failed takeover puts them back.
    #[test]
    fn a_mirror_keeps_the_entries_after_where_the_leaders_journal_is_whole_for_a_takeover() {
        let entry = |seq: u64| ToStandby::Entry { seq, changes: (0..10).map(|i| obj(&format!("k{seq}-{i}"), 1)).collect() };
        let base = |seq: u64, written: bool| ToStandby::Base { seq, written };
        // Room for four entries (of two-digit numbers; those of one digit are a byte shorter).
        let cap = 4 * encode_frame(&entry(10)).unwrap().len() + 2;
        let m = Mirror::new("c", Duration::from_secs(5), cap);
        m.set_leader(Some((5, 50)));
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 4, changes: vec![obj("a", 1)], last: false }).unwrap();
        m.apply(c, base(4, true)).unwrap();
        m.apply(c, ToStandby::Image { seq: 4, changes: vec![obj("b", 1)], last: true }).unwrap();
        assert_eq!(m.apply(c, entry(5)).unwrap(), Some(5));
        assert_eq!(m.status().tail_bytes, 0, "no run started (one said before the image was whole starts nothing): nothing kept");
        assert_eq!(m.apply(c, base(5, true)).unwrap(), None, "a run's start acknowledges nothing");
        // Entry 8 stands for log entries 6..=8 (appended to etcd in three values).
        for seq in [8, 9] {
            assert_eq!(m.apply(c, entry(seq)).unwrap(), Some(seq));
        }
        assert_eq!(m.status().tail_base, Some(5));
        let (image, seq, tail) = m.take_image(5).expect("complete");
        let run = tail.after(5, 9).expect("the run from 5");
        assert_eq!(run.iter().map(|f| (f.first, f.last)).collect::<Vec<_>>(), [(6, 8), (9, 9)]);
        for f in &run {
            assert_eq!(decode_frame::<ToStandby>(&f.frame).unwrap().map(|(e, _)| e), Some(entry(f.last)), "the frame as it was sent");
        }
        let firsts = |v: Option<Vec<TailFrame>>| v.map(|v| v.iter().map(|f| f.first).collect::<Vec<_>>());
        assert_eq!(firsts(tail.after(8, 9)), Some(vec![9]));
        assert_eq!(firsts(tail.after(9, 9)), Some(vec![]), "the journal holds everything: nothing to write");
        assert_eq!(firsts(tail.after(7, 9)), None, "the journal ends inside a frame");
        assert_eq!(firsts(tail.after(4, 9)), None, "the journal ends before the run's start (entry 5 was not kept)");
        assert_eq!(firsts(tail.after(10, 9)), None, "the journal holds more than the mirror");
        assert_eq!(firsts(tail.after(5, 10)), None, "the frames do not reach the mirror's last entry");
        m.restore(5, image, seq, tail);
        m.reopen();
        // (Restored: the same mirror, its tail too.)
        let (image, seq, tail) = m.take_image(5).expect("restored");
        assert_eq!((seq, firsts(tail.after(5, 9))), (9, Some(vec![6, 9])));
        m.restore(5, image, seq, tail);

        // A leader's hello starts the mirror and its tail again.
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 20, changes: vec![], last: true }).unwrap();
        assert_eq!(m.status().tail_bytes, 0, "none from the earlier feed");
        m.apply(c, base(20, true)).unwrap();
        for seq in [21, 22] {
            m.apply(c, entry(seq)).unwrap();
        }
        m.apply(c, base(21, false)).unwrap();
        assert_eq!(m.status().tail_base, Some(20), "a start that is not right after the last entry starts nothing");
        // A background snapshot at 22: its run starts, and the current one is kept until its
        // head is written.
        m.apply(c, base(22, false)).unwrap();
        for seq in [23, 24] {
            m.apply(c, entry(seq)).unwrap();
        }
        let (image, seq, tail) = m.take_image(5).expect("complete");
        assert_eq!((firsts(tail.after(20, 24)), firsts(tail.after(22, 24))), (Some(vec![21, 22, 23, 24]), Some(vec![23, 24])), "either run, whichever the journal ends at");
        m.restore(5, image, seq, tail);
        m.reopen();
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 22, changes: vec![], last: true }).unwrap();
        m.apply(c, base(20, true)).unwrap();
        m.apply(c, base(22, false)).unwrap();
        m.apply(c, base(20, true)).unwrap();
        assert_eq!(m.status().tail_base, None, "a written start this mirror has no run from drops the others (they do not reach back to it)");
        m.apply(c, base(22, false)).unwrap();
        m.apply(c, entry(23)).unwrap();
        m.apply(c, base(22, true)).unwrap();
        assert_eq!(m.take_image(5).map(|(_, _, t)| firsts(t.after(22, 23))), Some(Some(vec![23])));
        m.reopen();
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 30, changes: vec![], last: true }).unwrap();
        m.apply(c, base(30, true)).unwrap();
        m.apply(c, entry(31)).unwrap();
        m.apply(c, base(31, false)).unwrap();
        m.apply(c, entry(32)).unwrap();
        m.apply(c, base(32, false)).unwrap();
        m.apply(c, entry(33)).unwrap();
        let (image, seq, tail) = m.take_image(5).expect("complete");
        assert_eq!((firsts(tail.after(30, 33)), firsts(tail.after(31, 33)), firsts(tail.after(32, 33))), (None, Some(vec![32, 33]), Some(vec![33])), "at most two runs: the oldest goes");
        m.restore(5, image, seq, tail);
        m.reopen();

        // A run that would pass the cap is dropped, and nothing is kept until the next start.
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(c, ToStandby::Image { seq: 40, changes: vec![], last: true }).unwrap();
        m.apply(c, base(40, true)).unwrap();
        for seq in 41..=44 {
            m.apply(c, entry(seq)).unwrap();
        }
        assert!(m.status().tail_bytes > 0 && m.status().tail_bytes <= cap);
        m.apply(c, entry(45)).unwrap();
        assert_eq!(m.status().tail_bytes, 0, "outgrew the cap: dropped");
        m.apply(c, entry(46)).unwrap();
        assert_eq!(m.status().tail_bytes, 0, "and none kept after");
        m.apply(c, base(46, true)).unwrap();
        m.apply(c, entry(47)).unwrap();
        let (_, _, tail) = m.take_image(5).expect("complete");
        assert_eq!((firsts(tail.after(40, 47)), firsts(tail.after(46, 47))), (None, Some(vec![47])), "an entry the journal lacks was dropped: the whole state is written instead");

        // A standby that links while others are in sync gets, right after its image, the
        // entries from where the journal is whole up to its image, kept and not applied.
        m.reopen();
        let kept = |first: u64, last: u64| KeptFrame { first, last, frame: bytes::Bytes::from(encode_frame(&entry(last)).unwrap()) };
        let joined = |run: ToStandby| {
            m.reopen();
            let c = m.hello("c", 5, 50).unwrap();
            m.apply(c, ToStandby::Image { seq: 60, changes: vec![obj("z", 1)], last: true }).unwrap();
            assert_eq!(m.apply(c, run).unwrap(), None, "a run acknowledges nothing");
            m.apply(c, entry(61)).unwrap();
            m.apply_pending();
            assert_eq!(m.status().objects, 11, "the run's entries are not applied: the image holds them");
            m.take_image(5).expect("complete").2
        };
        let t = joined(ToStandby::Run { base: 57, frames: vec![kept(58, 58), kept(59, 60)] });
        assert_eq!(firsts(t.after(57, 61)), Some(vec![58, 59, 61]));
        assert_eq!(firsts(t.after(58, 61)), Some(vec![59, 61]));
        assert_eq!(t.after(57, 61).expect("whole")[1].frame.as_slice(), &encode_frame(&entry(60)).unwrap()[..], "the frame as the leader sent it");
        assert_eq!(firsts(joined(ToStandby::Run { base: 60, frames: vec![] }).after(60, 61)), Some(vec![61]), "an image at the run's start");
        assert_eq!(joined(ToStandby::Run { base: 57, frames: vec![kept(58, 58), kept(59, 59)] }).after(57, 61).map(|t| t.len()), None, "a run that does not end at the image is not kept");
        assert_eq!(joined(ToStandby::Run { base: 57, frames: vec![kept(58, 58), kept(60, 60)] }).after(57, 61).map(|t| t.len()), None, "nor one with a gap");
        assert_eq!(joined(ToStandby::Run { base: 50, frames: (51..=60).map(|n| kept(n, n)).collect() }).after(50, 61).map(|t| t.len()), None, "nor one over the cap");

        let none = Mirror::new("c", Duration::from_secs(5), 0);
        none.set_leader(Some((5, 50)));
        let c = none.hello("c", 5, 50).unwrap();
        none.apply(c, ToStandby::Image { seq: 1, changes: vec![], last: true }).unwrap();
        none.apply(c, base(1, true)).unwrap();
        none.apply(c, entry(2)).unwrap();
        assert_eq!(none.take_image(5).expect("complete").2.after(1, 2).map(|t| t.len()), None, "a cap of 0 keeps none");
    }

    struct Sink;
    impl AckSink for Sink {
        fn acked(&self) {}
        fn broke(&self) {}
    }

    fn cluster_key(c: char) -> Option<kvferry::auth::ClusterKey> {
        Some(kvferry::auth::ClusterKey::parse(c.to_string().repeat(64).as_bytes(), std::path::Path::new("k")).expect("key"))
    }

    /// A standby of cluster "c", member "s", holding `key`, following the leader of term 5,
    /// served on 127.0.0.1: its mirror and address.
    fn standby(key: Option<kvferry::auth::ClusterKey>) -> (Arc<Mirror>, String) {
        let m = Arc::new(Mirror::new("c", Duration::from_secs(5), 1 << 20).with_auth(key, "s"));
        m.set_leader(Some((5, 50)));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let m2 = Arc::clone(&m);
        std::thread::spawn(move || serve(listener, m2));
        (m, addr)
    }

    /// Links `member` at `addr` holding `key`, sends an image and an entry (an object each):
    /// the entry acknowledged, whether the link ended, and what the standby mirrors.
    fn link_to(member: &str, addr: &str, key: Option<kvferry::auth::ClusterKey>, m: &Mirror) -> (u64, bool, usize) {
        let hello = ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "l".into() };
        let l = Link::open(member, addr, &hello, key, Arc::new(Sink)).expect("link");
        for f in [ToStandby::Image { seq: 1, changes: vec![obj("a", 1)], last: true }, ToStandby::Entry { seq: 2, changes: vec![obj("b", 1)] }] {
            l.send(&Arc::new(encode_frame(&f).expect("frame")));
        }
        let until = Instant::now() + Duration::from_secs(5);
        while l.acked() < 2 && !l.dead() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        (l.acked(), l.dead(), m.status().objects)
    }

    /// With a cluster key, a leader links only to a standby that answers its handshake and a
    /// standby follows only a leader whose first sealed frame opens: holding the same key,
    /// entries flow (sealed, many frames, large ones in several messages) and are
    /// acknowledged; another key, a key on one side only, or a link dialing another member
    /// (a relay, a stale address) and the link ends before the hello, the mirror untouched.
    #[test]
    fn a_replication_link_needs_the_same_cluster_key_on_both_sides() {
        // (The handshake's frames came last: the others keep their wire numbers.)
        let first = |f: Vec<u8>| f[4];
        assert_eq!([first(encode_frame(&ToStandby::AuthHello { hello: vec![] }).unwrap()), first(encode_frame(&ToStandby::AuthProof { mac: vec![] }).unwrap())], [AUTH_HELLO, 6]);
        assert_eq!(first(encode_frame(&ToLeader::AuthChallenge { answer: vec![] }).unwrap()), 2);
        let longest = encode_frame(&ToStandby::AuthHello { hello: vec![7; kvferry::auth::MAX_HELLO_LEN] }).unwrap();
        assert_eq!(longest.len() - 4, MAX_AUTH_HELLO_FRAME);
        assert_eq!(crate::proto::bytes_variant(&longest[4..], AUTH_HELLO), Some(&[7u8; kvferry::auth::MAX_HELLO_LEN][..]));
        let link = |leader: Option<kvferry::auth::ClusterKey>, standby_key: Option<kvferry::auth::ClusterKey>| {
            let (m, addr) = standby(standby_key);
            link_to("s", &addr, leader, &m)
        };
        assert_eq!(link(cluster_key('a'), cluster_key('a')), (2, false, 2), "the same key: linked, both objects mirrored");
        assert_eq!(link(None, None), (2, false, 2), "no key on either side, as before");
        for (leader, standby, what) in [(cluster_key('a'), cluster_key('b')), (cluster_key('a'), None), (None, cluster_key('a'))].into_iter().zip(["another key", "the standby has none", "the leader has none"]).map(|((l, s), w)| (l, s, w)) {
            let (acked, dead, objects) = link(leader, standby);
            assert_eq!((acked, dead, objects), (0, true, 0), "{what}: the link ends, nothing is mirrored");
        }
        let (m, addr) = standby(cluster_key('a'));
        assert_eq!(link_to("t", &addr, cluster_key('a'), &m), (0, true, 0), "a link dialing member t, at member s's address");
        let k = cluster_key('a').expect("key");
        let mut c = TcpStream::connect(&addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let (_, hello) = kvferry::auth::Initiator::new(&k, HA_LINK, &standby_identity("c", "t")).expect("hello");
        c.write_all(&encode_frame(&ToStandby::AuthHello { hello }).expect("frame")).expect("send");
        match read_frame::<ToLeader>(&mut c) {
            Ok(ToLeader::Refused { why }) => assert!(why.contains("meant for \"standby/c/t\"") && why.contains("\"standby/c/s\""), "{why}"),
            other => panic!("expected a refusal naming both members: {other:?}"),
        }
        // Sealed frames of every size open in order on the standby.
        let (m, addr) = standby(cluster_key('a'));
        let hello = ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "l".into() };
        let l = Link::open("s", &addr, &hello, cluster_key('a'), Arc::new(Sink)).expect("link");
        let many: Vec<Change> = (0..20_000).map(|i| obj(&format!("k{i:06}"), 1)).collect();
        l.send(&Arc::new(encode_frame(&ToStandby::Image { seq: 1, changes: many, last: true }).expect("frame")));
        for seq in 2..200 {
            l.send(&Arc::new(encode_frame(&ToStandby::Entry { seq, changes: vec![obj(&format!("e{seq}"), 1)] }).expect("frame")));
        }
        let until = Instant::now() + Duration::from_secs(10);
        while l.acked() < 199 && !l.dead() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((l.acked(), l.dead()), (199, false));
        m.apply_pending();
        assert_eq!(m.status().objects, 20_000 + 198);
    }

    /// A keyless host between a keyed leader and its standby forwards the handshake, then
    /// injects a frame of its own, or alters or replays one of the leader's: the standby
    /// takes nothing of it (the frame does not open) and the link ends. A leader's hello and
    /// first frame replayed on a new connection: answered, then refused.
    #[test]
    fn a_relayed_link_whose_frames_are_injected_altered_or_replayed_is_refused() {
        enum Then {
            Inject,
            Alter,
            Replay,
        }
        for then in [Then::Inject, Then::Alter, Then::Replay] {
            let (m, addr) = standby(cluster_key('a'));
            // The relay: forwards the leader's hello and the standby's answer (plain frames),
            // then does `then` with what the leader sends next.
            let relay = TcpListener::bind("127.0.0.1:0").expect("bind");
            let at = relay.local_addr().expect("addr").to_string();
            let (addr2, m2) = (addr.clone(), Arc::clone(&m));
            let t = std::thread::spawn(move || {
                let (mut leader, _) = relay.accept().expect("accept");
                let mut standby = TcpStream::connect(&addr2).expect("connect");
                for s in [&leader, &standby] {
                    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                }
                let (_, hello) = read_frame_raw::<ToStandby>(&mut leader, MAX_SMALL_FRAME).expect("the leader's hello");
                standby.write_all(&hello).expect("forward");
                let (_, answer) = read_frame_raw::<ToLeader>(&mut standby, MAX_SMALL_FRAME).expect("the answer");
                leader.write_all(&answer).expect("forward");
                // What the leader sends next: its sealed Hello, whose size the relay knows (the
                // sealed form of the hello the test's leader says).
                let said = encode_frame(&ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "l".into() }).expect("frame");
                let mut next = vec![0u8; kvferry::auth::FRAME_HEAD_LEN + kvferry::auth::frame_body_len(said.len() - 4)];
                leader.read_exact(&mut next).expect("the leader's sealed hello");
                match then {
                    Then::Inject => {
                        let mut f = encode_frame(&ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "relay".into() }).expect("frame");
                        f.extend(encode_frame(&ToStandby::Image { seq: 1, changes: vec![obj("injected", 1)], last: true }).expect("frame"));
                        standby.write_all(&f).expect("inject");
                    }
                    Then::Alter => {
                        let last = next.len() - 1;
                        next[last] ^= 1;
                        standby.write_all(&next).expect("forward");
                    }
                    Then::Replay => {
                        // A new connection: the hello replayed is answered, the frames are not taken.
                        let mut again = TcpStream::connect(&addr2).expect("connect");
                        again.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                        again.write_all(&hello).expect("replay");
                        assert!(matches!(read_frame::<ToLeader>(&mut again), Ok(ToLeader::AuthChallenge { .. })), "a replayed hello gets an answer");
                        again.write_all(&next).expect("replay");
                        let mut rest = Vec::new();
                        let _ = again.read_to_end(&mut rest);
                        assert_eq!(m2.status().objects, 0, "nothing replayed was taken");
                        // (The real connection is not forwarded.)
                        return;
                    }
                }
                let mut rest = Vec::new();
                let _ = standby.read_to_end(&mut rest);
            });
            let hello = ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "l".into() };
            let l = Link::open("s", &at, &hello, cluster_key('a'), Arc::new(Sink)).expect("link");
            l.send(&Arc::new(encode_frame(&ToStandby::Image { seq: 1, changes: vec![obj("a", 1)], last: true }).expect("frame")));
            t.join().expect("the relay");
            m.apply_pending();
            let st = m.status();
            assert_eq!((st.objects, st.fed, l.acked()), (0, false, 0), "nothing taken from the relay");
        }
    }

    /// Frames that came together get one acknowledgement, of the last entry among them, even
    /// when a frame that acknowledges nothing (a run's start) comes after it: dropped, the
    /// leader would wait for an entry the standby holds until the standby left the set.
    #[test]
    fn an_entry_followed_by_a_run_start_in_one_read_is_acknowledged() {
        let m = Arc::new(Mirror::new("c", Duration::from_secs(5), 1 << 20));
        m.set_leader(Some((5, 50)));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let m2 = Arc::clone(&m);
        std::thread::spawn(move || serve(listener, m2));
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(&encode_frame(&ToStandby::Hello { cluster_id: "c".into(), term: 5, lease: 50, leader: "l".into() }).expect("frame")).expect("hello");
        // (The hello is read on its own; what follows comes in one write, one read.)
        std::thread::sleep(Duration::from_millis(100));
        let mut bytes = Vec::new();
        for f in [ToStandby::Image { seq: 4, changes: vec![obj("a", 1)], last: true }, ToStandby::Entry { seq: 5, changes: vec![obj("b", 1)] }, ToStandby::Base { seq: 5, written: true }] {
            bytes.extend(encode_frame(&f).expect("frame"));
        }
        s.write_all(&bytes).expect("frames");
        let mut acked = 0;
        while acked < 5 {
            match read_frame::<ToLeader>(&mut s) {
                Ok(ToLeader::Ack { seq }) => acked = seq,
                other => panic!("expected the acknowledgement of entry 5 (got {acked} so far), got {other:?}"),
            }
        }
        assert_eq!(m.status().tail_base, Some(5));
    }

    /// An image's frames hold its changes in order, the last one marked; the caller is let in
    /// between frames once the encoding took `hold`, and can give the image up there.
    #[test]
    fn an_image_is_encoded_in_frames_letting_its_caller_in_between() {
        let changes: Vec<Change> = (0..3 * IMAGE_PIECE + 5).map(|i| obj(&format!("k{i}"), 1)).collect();
        let mut calls = 0;
        let frames = image_frames(9, changes.clone(), Duration::ZERO, || {
            calls += 1;
            true
        })
        .expect("frames");
        assert_eq!((frames.len(), calls), (4, 3), "let in between each two frames");
        let mut back = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            match decode_frame::<ToStandby>(f).expect("decodes") {
                Some((ToStandby::Image { seq: 9, changes, last }, _)) => {
                    assert_eq!(last, i == 3);
                    back.extend(changes);
                }
                other => panic!("an image frame, got {other:?}"),
            }
        }
        assert_eq!(back, changes);
        let mut calls = 0;
        assert!(image_frames(9, changes.clone(), Duration::from_secs(3600), || {
            calls += 1;
            true
        })
        .is_ok());
        assert_eq!(calls, 0, "not before the hold");
        let mut n = 0;
        let r = image_frames(9, changes, Duration::ZERO, || {
            n += 1;
            n < 2
        });
        assert!(r.is_err() && n == 2, "given up when the caller says so");
    }

    /// A joining standby's run goes in frames of about [`RUN_PIECE`] bytes, the caller let in
    /// between them; the standby keeps it once the frames reach its image, and not if an entry
    /// comes first.
    #[test]
    fn a_run_for_a_joining_standby_goes_in_pieces_and_is_kept_once_whole() {
        let frames: Vec<TailFrame> = (58..=61).map(|n| TailFrame { first: n, last: n, frame: Arc::new(vec![n as u8; RUN_PIECE / 2 + 1]) }).collect();
        let mut calls = 0;
        let pieces = run_frames(57, &frames, Duration::ZERO, || {
            calls += 1;
            true
        })
        .expect("frames");
        assert_eq!((pieces.len(), calls), (4, 3), "a frame each (two would pass the piece's size), the caller let in between");
        let decoded: Vec<(u64, Vec<KeptFrame>)> = pieces
            .iter()
            .map(|p| match decode_frame::<ToStandby>(p).expect("decodes") {
                Some((ToStandby::Run { base, frames }, _)) => (base, frames),
                other => panic!("a run frame, got {other:?}"),
            })
            .collect();
        let cap = 64 << 20;
        let mut t = MirrorTail::default();
        for (i, (base, kept)) in decoded.iter().cloned().enumerate() {
            assert!(t.after(57, 61).is_none(), "not kept before it reaches the image ({i} pieces)");
            t.joined(base, kept, 61, cap);
        }
        let run = t.after(57, 61).expect("kept once whole");
        assert_eq!(run.iter().map(|f| (f.first, f.frame.len(), f.frame[0])).collect::<Vec<_>>(), (58..=61).map(|n| (n, RUN_PIECE / 2 + 1, n as u8)).collect::<Vec<_>>());
        let mut t = MirrorTail::default();
        for (base, kept) in decoded.iter().take(2).cloned() {
            t.joined(base, kept, 61, cap);
        }
        t.push(62, 62, vec![1], cap);
        t.joined(decoded[2].0, decoded[2].1.clone(), 61, cap);
        t.joined(decoded[3].0, decoded[3].1.clone(), 61, cap);
        assert!(t.after(57, 62).is_none() && t.after(57, 61).is_none(), "an entry came before the run reached the image: not kept");
        let mut n = 0;
        assert!(run_frames(57, &frames, Duration::ZERO, || {
            n += 1;
            false
        })
        .is_err() && n == 1, "given up when the caller says so");
    }

    #[test]
    fn a_registration_says_where_the_mirror_is_its_term_and_that_it_takes_runs() {
        assert_eq!(parse_registration(&registration("1.2.3.4:5", Some(7))), Registration { addr: "1.2.3.4:5", mirror: Some(7), runs: true, grants: true });
        assert_eq!(parse_registration(&registration("1.2.3.4:5", None)), Registration { addr: "1.2.3.4:5", mirror: None, runs: true, grants: true });
        assert_eq!(parse_registration("1.2.3.4:5 7 runs"), Registration { addr: "1.2.3.4:5", mirror: Some(7), runs: true, grants: false }, "the last version's");
        // As an earlier version wrote them, and as it reads these (its first two words).
        assert_eq!(parse_registration("1.2.3.4:5 7"), Registration { addr: "1.2.3.4:5", mirror: Some(7), runs: false, grants: false });
        assert_eq!(parse_registration("1.2.3.4:5"), Registration { addr: "1.2.3.4:5", mirror: None, runs: false, grants: false });
        let old = |v: &str| {
            let mut w = v.split_whitespace();
            (w.next().map(str::to_string), w.next().and_then(|t| t.parse::<i64>().ok()))
        };
        assert_eq!(old(&registration("a:1", None)), (Some("a:1".to_string()), None));
        assert_eq!(old(&registration("a:1", Some(3))), (Some("a:1".to_string()), Some(3)));
    }

    #[test]
    fn a_stopping_member_is_needed_only_as_the_last_holder_of_its_terms_mirror() {
        let rec = InSync { term: 7, members: vec!["a:1".into(), "b:1".into()] };
        assert!(needed_at_stop(&rec, "a:1", Some(7), |_| false), "the only member alive with the record's mirror");
        assert!(!needed_at_stop(&rec, "a:1", Some(7), |m| m == "b:1"), "another member alive holds it too");
        assert!(!needed_at_stop(&rec, "a:1", Some(6), |_| false), "a mirror of another term is not what was acknowledged");
        assert!(!needed_at_stop(&rec, "a:1", None, |_| false));
        assert!(!needed_at_stop(&rec, "c:1", Some(7), |_| false), "not a member: the leader did not wait for it");
        assert!(!needed_at_stop(&InSync::default(), "a:1", Some(7), |_| false), "the set is empty: etcd holds everything");
    }

    #[test]
    fn a_sealed_mirror_is_fed_no_more_and_keeps_what_it_holds() {
        let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
        m.set_leader(Some((5, 50)));
        let c = m.hello("c", 5, 50).unwrap();
        assert_eq!(m.apply(c, ToStandby::Image { seq: 3, changes: vec![obj("a", 1)], last: true }).unwrap(), Some(3));
        m.apply_pending();
        assert_eq!(m.status(), MirrorStatus { term: 5, seq: 3, complete: true, fed: true, sealed: false, pending_changes: 0, objects: 1, tail_bytes: 0, tail_base: None });
        m.seal();
        assert_eq!(m.status(), MirrorStatus { term: 5, seq: 3, complete: true, fed: false, sealed: true, pending_changes: 0, objects: 1, tail_bytes: 0, tail_base: None });
        assert!(m.apply(c, ToStandby::Entry { seq: 4, changes: vec![obj("b", 1)] }).is_err(), "its feed ended");
        assert!(m.hello("c", 5, 50).is_err(), "no leader feeds it again");
        assert_eq!(m.complete_term(), Some(5), "still a mirror to lead from");
        assert_eq!(m.take_image(5).map(|(i, s, _)| (i.objects(), s)), Some((1, 3)));
        m.reopen();
        assert!(m.hello("c", 5, 50).is_err(), "sealed for good");

        // A connection that ended feeds its mirror no more, and says so.
        let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
        m.set_leader(Some((5, 50)));
        let c = m.hello("c", 5, 50).unwrap();
        assert!(m.status().fed);
        m.detach(c);
        assert!(!m.status().fed, "its connection ended");
        assert!(m.apply(c, ToStandby::Image { seq: 1, changes: vec![], last: true }).is_err());
    }

    /// Held-back space is pruned from a mirror once two read leases passed, except what the
    /// leader still held for longer (a write that may still land): that is taken over with
    /// the time it has left.
    #[test]
    fn a_mirror_keeps_held_space_as_long_as_the_leader_held_it() {
        let m = Mirror::new("c", Duration::from_millis(1), 1 << 20);
        m.set_leader(Some((5, 50)));
        let c = m.hello("c", 5, 50).unwrap();
        let seg = crate::proto::Segment { id: 1, name: "s".into(), te_endpoint: "127.0.0.1:1".into(), base: 0, size: 1 << 20 };
        let changes = vec![Change::Mount { client: 7, seg }, Change::HeldBack { replica: (1, 0, 4096) }, Change::HeldUntil { replica: (1, 4096, 4096), left: 0 }, Change::HeldUntil { replica: (1, 8192, 4096), left: 60_000 }];
        assert_eq!(m.apply(c, ToStandby::Image { seq: 1, changes, last: true }).unwrap(), Some(1));
        m.apply_pending();
        std::thread::sleep(Duration::from_millis(20));
        m.apply_pending();
        let (image, _, _) = m.take_image(5).expect("a complete mirror");
        let (st, _) = image.into_state(6, 0, 1);
        assert_eq!(st.summary().deferred_frees, 1, "only the range held for a minute is still held");
        assert_eq!(st.used_bytes(), 4096);
        let mut st = st;
        st.release_deferred(58_000);
        assert_eq!(st.used_bytes(), 4096, "held for what it had left (about a minute)");
        st.release_deferred(60_001);
        assert_eq!(st.used_bytes(), 0);
    }

    #[test]
    fn only_a_member_with_its_terms_mirror_leads_and_a_dead_set_means_starting_empty() {
        let rec = InSync { term: 7, members: vec!["a:1".into(), "b:1".into()] };
        assert_eq!(eligibility(&InSync::default(), "c:1", None, |_| true), Eligibility::Journal);
        assert_eq!(eligibility(&rec, "a:1", Some(7), |_| true), Eligibility::Mirror);
        assert_eq!(eligibility(&rec, "a:1", Some(6), |_| true), Eligibility::Wait, "a mirror of another term is not the one acknowledged");
        assert_eq!(eligibility(&rec, "a:1", None, |_| false), Eligibility::Empty, "the only member left lost its mirror");
        assert_eq!(eligibility(&rec, "c:1", None, |m| m == "b:1"), Eligibility::Wait, "a member is alive: only it may lead");
        assert_eq!(eligibility(&rec, "c:1", None, |_| false), Eligibility::Empty);
        assert_eq!(InSync::parse(&rec.to_bytes()).unwrap(), rec);
        assert_eq!(InSync::parse(b"").unwrap(), InSync::default());
        assert!(InSync::parse(b"{").is_err());
    }
}
