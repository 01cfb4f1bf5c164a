//! The master's RPC protocol: length-prefixed postcard messages over TCP.
//!
//! Frame: `u32` little-endian payload length, then a postcard-encoded [`Request`] or
//! [`Response`]. One request, one response, in order, per connection. [`Request::Batch`]
//! carries many operations in one round trip. The codec below is pure (sans-IO): the frame is
//! [`crate::frame`]'s, shared with the HA replication link; this module adds its limits, its
//! errors and the bounds a master decodes a request within.
//!
//! With the cluster key (`KVFERRY_AUTH_KEY_FILE`, `kvferry::auth`), a connection opens with
//! the Noise handshake of [`STORE_RPC`] towards [`master_identity`] of the master's cluster:
//! [`Request::AuthHello`] (the client's opening message, a plain frame) answered by
//! [`Response::AuthChallenge`] (the master's answer, a plain frame); after it every frame
//! both ways is sealed under the session instead (`kvferry::auth::Sealer::seal_frame`: the
//! sealed length, then the sealed postcard body; no plain length prefix), the client's first
//! request first.

use crate::error::{StoreError, StoreResult};
use crate::frame;
use serde::{Deserialize, Serialize};

mod tasks;
pub use tasks::{CopyPlan, TaskAssignment, TaskId, TaskInfo, TaskKind, TaskStatus};

/// Largest frame accepted (a batch of many keys fits easily).
pub const MAX_FRAME: usize = 64 << 20;

/// The most requests (or answers) one batch holds: a 64 MiB frame of two-byte pings would
/// otherwise decode into 33 M requests (4 GB).
pub const MAX_BATCH: usize = 1 << 20;

/// The vectors one request frame decodes into ([`decode_request`]: the batch's and those in
/// its requests) hold at most this many bytes, or [`DECODE_FACTOR`] times the frame's length
/// if that is more. A request takes 128 bytes in memory and a ping two on the wire: without
/// this bound a 2 MB frame of pings grew the master's heap by 126 MB.
pub const DECODE_ALLOWANCE: usize = 1 << 20;

/// See [`DECODE_ALLOWANCE`].
pub const DECODE_FACTOR: usize = 16;

/// The Noise protocol of the store's RPC (`kvferry::auth`).
pub const STORE_RPC: kvferry::auth::Protocol = kvferry::auth::Protocol("kvferry/store-rpc/1");

/// The identity a client dials and a master answers to: its cluster (`--cluster-id`, else
/// `KVFERRY_STORE_CLUSTER_ID` / `MC_STORE_CLUSTER_ID`, else `mooncake_cluster`; a trailing
/// `/` dropped, as in `crate::ha::master_view_key`), so that a handshake made for one
/// cluster's master is refused by another's.
pub fn master_identity(cluster_id: &str) -> String {
    format!(
        "master/{}",
        cluster_id.strip_suffix('/').unwrap_or(cluster_id)
    )
}

/// The wire number of [`Request::AuthHello`].
const AUTH_HELLO: u8 = 16;

/// The longest body of the first frame a master holding the cluster key reads: an
/// [`Request::AuthHello`] carrying the longest opening message (its variant, the bytes'
/// length in at most two bytes, the bytes). A longer length prefix is refused before anything
/// is read or allocated.
pub const MAX_AUTH_HELLO_FRAME: usize = 1 + 2 + kvferry::auth::MAX_HELLO_LEN;

/// The opening message an [`Request::AuthHello`] frame body carries, read without decoding
/// anything else (`None`: the body is not exactly one `AuthHello`).
pub fn auth_hello_of(body: &[u8]) -> Option<&[u8]> {
    bytes_variant(body, AUTH_HELLO)
}

/// The bytes a postcard body carries when it is exactly the enum variant `variant` holding
/// one byte vector of at most 16383 bytes (`None` otherwise), read without decoding.
pub(crate) fn bytes_variant(body: &[u8], variant: u8) -> Option<&[u8]> {
    let (&v, rest) = body.split_first()?;
    if v != variant {
        return None;
    }
    // The length: a postcard varint, at most two bytes here.
    let (len, rest) = match rest {
        [b0, rest @ ..] if b0 & 0x80 == 0 => (*b0 as usize, rest),
        [b0, b1, rest @ ..] if b1 & 0x80 == 0 && *b1 != 0 => {
            ((b0 & 0x7f) as usize | (*b1 as usize) << 7, rest)
        }
        _ => return None,
    };
    (rest.len() == len).then_some(rest)
}

/// Why [`de_batch`] or [`de_seq`] refused.
#[derive(Clone, Copy)]
enum Refusal {
    Nested,
    TooMany,
    TooLarge,
}

std::thread_local! {
    /// Batches being decoded on this thread (see [`de_batch`]).
    static BATCH_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Why [`de_batch`] refused (postcard reports a custom error without its text).
    static REFUSED: std::cell::Cell<Option<Refusal>> = const { std::cell::Cell::new(None) };
    /// Bytes the vectors being decoded may still take ([`decode_request`]; `None`: no bound).
    static BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Makes room for one more element in `v`, within the decoding's budget ([`BUDGET`]): the
/// capacity doubles, but never past what the budget has left.
fn room<T, E: serde::de::Error>(v: &mut Vec<T>) -> Result<(), E> {
    if v.len() < v.capacity() {
        return Ok(());
    }
    let size = std::mem::size_of::<T>().max(1);
    let want = v.capacity().max(4);
    let add = match BUDGET.with(|b| b.get()) {
        None => want,
        Some(left) => {
            let add = want.min(left / size);
            if add == 0 {
                REFUSED.with(|r| r.set(Some(Refusal::TooLarge)));
                return Err(E::custom("a request decodes past its bound"));
            }
            BUDGET.with(|b| b.set(Some(left - add * size)));
            add
        }
    };
    v.reserve_exact(add);
    Ok(())
}

/// Decodes a sequence growing as elements arrive, within the decoding's budget ([`room`]):
/// nothing is reserved by a claimed length.
fn de_seq<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    struct V<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(x) = seq.next_element()? {
                room(&mut out)?;
                out.push(x);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V(std::marker::PhantomData))
}

/// Decodes a batch's requests or answers: refuses a batch inside a batch at once (decoding
/// recurses once per level, and a frame of nested batches overflowed the connection thread's
/// stack, aborting the master) and more than [`MAX_BATCH`] elements; grows as elements
/// arrive (nothing reserved by a claimed length), within the decoding's budget ([`room`]).
fn de_batch<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Vec<T>, D::Error> {
    use serde::de::Error;
    struct Level;
    impl Drop for Level {
        fn drop(&mut self) {
            BATCH_DEPTH.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    let depth = BATCH_DEPTH.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    let _level = Level;
    if depth > 1 {
        REFUSED.with(|r| r.set(Some(Refusal::Nested)));
        return Err(D::Error::custom("nested batches are not allowed"));
    }
    struct V<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a batch")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(x) = seq.next_element()? {
                if out.len() == MAX_BATCH {
                    REFUSED.with(|r| r.set(Some(Refusal::TooMany)));
                    return Err(A::Error::custom("a batch over MAX_BATCH"));
                }
                room(&mut out)?;
                out.push(x);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V(std::marker::PhantomData))
}

/// A memory segment a client contributes to the pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Chosen by the client, unique per mount.
    pub id: u64,
    /// Logical name (what `preferred_segment` refers to): the transfer engine segment name.
    pub name: String,
    /// The transfer-engine segment that holds the memory (`host:port` in P2P mode).
    pub te_endpoint: String,
    pub base: u64,
    pub size: u64,
}

/// Soft pin behaviour of a write (Mooncake's `SoftPinAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum SoftPin {
    /// Keep an existing object's pin as it is (new objects are not pinned).
    #[default]
    Preserve,
    Enable,
    Disable,
}

/// How an object is replicated and kept (Mooncake's `ReplicateConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicateConfig {
    pub replica_num: u32,
    pub soft_pin: SoftPin,
    /// Soft pin duration; `None` uses the master's default.
    pub soft_pin_ttl_ms: Option<u64>,
    pub with_hard_pin: bool,
    /// Segment names tried first, in order.
    #[serde(deserialize_with = "de_seq")]
    pub preferred_segments: Vec<String>,
    /// Optional object group: shared lease refresh and eviction.
    pub group_id: Option<String>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            soft_pin: SoftPin::Preserve,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segments: Vec::new(),
            group_id: None,
        }
    }
}

/// Where one replica lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaDesc {
    /// Transfer-engine segment to read or write.
    pub te_endpoint: String,
    /// Absolute virtual address inside that segment.
    pub addr: u64,
    pub size: u64,
}

/// Answer to a successful `GetReplicaList`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaList {
    pub replicas: Vec<ReplicaDesc>,
    pub size: u64,
    /// The read lease granted, counted from when the master answered.
    pub lease_ttl_ms: u64,
    /// Names this read for [`Request::ReleaseReads`]: until the reader releases it (or the
    /// lease runs out) the replicas listed are neither freed nor reused.
    pub read_id: u64,
}

/// A value's copy on a client's disk (the disk tier), as the master names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskDesc {
    /// The owner client's address for disk reads (empty: its client has not reported to
    /// this master yet; the copy cannot be read until it does).
    pub endpoint: String,
    /// The disk's id (chosen by its directory, kept across restarts of its client).
    pub disk: u64,
    pub size: u64,
}

/// What a client with a disk tier reports to the master at each heartbeat
/// ([`Request::OffloadBeat`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadBeat {
    /// The disk's id (`crate::disk::DiskTier::id`).
    pub disk: u64,
    /// Where readers fetch its objects.
    pub endpoint: String,
    /// Offload tasks whose object is now durable on the disk.
    #[serde(deserialize_with = "de_seq")]
    pub done: Vec<OffloadDone>,
    /// Offload tasks the client could not carry out (disk full, I/O error, bytes not in its
    /// segment): the object is evicted from memory as it would have been without a disk.
    #[serde(deserialize_with = "de_seq")]
    pub failed: Vec<u64>,
    /// Keys whose record left the disk (its own eviction, a corrupt or missing record).
    #[serde(deserialize_with = "de_seq")]
    pub evicted: Vec<String>,
    /// Records found on the disk when the client opened it, `(key, length)`, sent in pieces
    /// after a restart: the master keeps those it still names and says to drop the others.
    #[serde(deserialize_with = "de_seq")]
    pub recovered: Vec<(String, u64)>,
}

/// An offload task carried out ([`OffloadBeat::done`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadDone {
    pub task: u64,
    pub key: String,
}

/// An object a client is to persist on its disk: the bytes at `addr` (in one of its own
/// segments), `size` long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadTask {
    pub task: u64,
    pub key: String,
    pub addr: u64,
    pub size: u64,
}

/// The master's answer to an [`OffloadBeat`]: objects to persist, and records to delete
/// (the master no longer names them), to be deleted first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadOrders {
    pub tasks: Vec<OffloadTask>,
    pub drop: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PingStatus {
    Ok,
    /// The master does not know this client (restarted, or TTL expired): remount.
    NeedRemount,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    MountSegment {
        client: u64,
        segment: Segment,
    },
    RemountSegments {
        client: u64,
        #[serde(deserialize_with = "de_seq")]
        segments: Vec<Segment>,
    },
    UnmountSegment {
        client: u64,
        segment: u64,
    },
    Ping {
        client: u64,
    },
    /// Starts put `put` of `key`: `put` is chosen by the client, distinct among its puts (a
    /// counter), and only a `PutEnd` or `PutRevoke` naming it ends this put, so the late end
    /// of an earlier put of the key (one discarded as a zombie meanwhile) never ends a later
    /// one before its bytes landed, and a start whose answer was lost is revoked exactly.
    PutStart {
        client: u64,
        key: String,
        size: u64,
        config: ReplicateConfig,
        upsert: bool,
        put: u64,
    },
    PutEnd {
        client: u64,
        key: String,
        put: u64,
    },
    PutRevoke {
        client: u64,
        key: String,
        put: u64,
    },
    GetReplicaList {
        key: String,
    },
    ExistKey {
        key: String,
    },
    Remove {
        key: String,
        force: bool,
    },
    RemoveAll {
        force: bool,
    },
    RemoveByRegex {
        pattern: String,
        force: bool,
    },
    /// Many operations in one round trip; answered by [`Response::Batch`] in the same order.
    Batch(#[serde(deserialize_with = "de_batch")] Vec<Request>),
    /// The reads named (`ReplicaList::read_id`) finished: their replicas may be reclaimed.
    /// Clients send it piggybacked on their next request (or with their next ping). Last, so
    /// the other variants keep their wire numbers.
    ReleaseReads {
        #[serde(deserialize_with = "de_seq")]
        ids: Vec<u64>,
    },
    /// Mooncake's `BatchReplicaClear`: drops the replicas of `keys` this client wrote whose
    /// lease ended, on `segment` (a segment name) or everywhere (empty); answered by
    /// [`Response::Keys`] with the keys cleared.
    BatchReplicaClear {
        client: u64,
        #[serde(deserialize_with = "de_seq")]
        keys: Vec<String>,
        segment: String,
    },
    /// Writes of this client still running (kvferry's; last, so the other variants keep their
    /// wire numbers): sent after a master answered that it did not know the client (it
    /// restarted without HA, so it knows nothing of the writes its predecessor placed). The
    /// master places nothing new in their segments until they are over, and drops the
    /// replicas it placed in their ranges since. Answered `Ok`.
    HoldWrites {
        client: u64,
        #[serde(deserialize_with = "de_seq")]
        writes: Vec<WriteInFlight>,
    },
    /// The first frame of a connection to a master that holds the cluster key
    /// (`KVFERRY_AUTH_KEY_FILE`, `kvferry::auth`), a plain one: the client's Noise opening
    /// message ([`STORE_RPC`], dialing [`master_identity`]). Answered by
    /// [`Response::AuthChallenge`], after which every frame is sealed; a master without a key,
    /// or one of another cluster or key, refuses it ([`StoreError::Unauthorized`]). Last, so
    /// the other variants keep their wire numbers.
    AuthHello {
        #[serde(deserialize_with = "de_seq")]
        hello: Vec<u8>,
    },
    /// Not sent (it kept the number of an earlier exchange's step): refused wherever it comes.
    AuthProof {
        #[serde(deserialize_with = "de_seq")]
        mac: Vec<u8>,
    },
    /// A client with a disk tier reports (Mooncake's `OffloadObjectHeartbeat` and
    /// `NotifyOffloadSuccess` in one): answered by [`Response::Offload`]. A master without
    /// offload refuses it. Last, so the other variants keep their wire numbers.
    /// (Boxed: a request's size in memory bounds how many a frame decodes into,
    /// [`DECODE_ALLOWANCE`].)
    OffloadBeat {
        client: u64,
        beat: Box<OffloadBeat>,
    },
    /// Mooncake 0.3.14's `probe_key`: whether `key` is readable now, answered by
    /// [`Response::Exists`] like `ExistKey`, but granting no read lease and leaving the
    /// object's access time alone (eviction order unchanged). Last, so the other variants
    /// keep their wire numbers.
    ProbeKey {
        key: String,
    },
    /// Mooncake 0.3.14's `CreateCopyTask`: a task for the client that owns one of `key`'s
    /// replicas (picked at random) to copy it to each of `targets` (segment names) that holds
    /// none. Answered by [`Response::Task`] with the task's id. (The tasks' requests are last,
    /// so the other variants keep their wire numbers.)
    CreateCopyTask {
        key: String,
        #[serde(deserialize_with = "de_seq")]
        targets: Vec<String>,
    },
    /// Mooncake 0.3.14's `CreateMoveTask`: a task for the client that owns `source` (a segment
    /// name holding a replica of `key`) to copy it to `target` and then drop the source
    /// replica. Answered by [`Response::Task`].
    CreateMoveTask {
        key: String,
        source: String,
        target: String,
    },
    /// Mooncake 0.3.14's `QueryTask`: answered by [`Response::TaskInfo`].
    QueryTask {
        id: TaskId,
    },
    /// The tasks assigned to `client` not handed out yet, at most `max` (they are then
    /// processing): answered by [`Response::Tasks`].
    FetchTasks {
        client: u64,
        max: u32,
    },
    /// Task `id`, assigned to `client`, ended: `ok` (SUCCESS) or not (FAILED), with a message.
    CompleteTask {
        client: u64,
        id: TaskId,
        ok: bool,
        message: String,
    },
    /// Reserves room for a copy of `key`'s replica on segment `source` in each of `targets`
    /// that holds no replica of it, and leases the source for the copier's read (Mooncake's
    /// `CopyStart`/`MoveStart`). `put` names the copy as it names a put (a `PutRevoke` of it
    /// gives its room back); `remove_source`: a move (its end drops the source replica).
    /// Answered by [`Response::Copy`].
    CopyStart {
        client: u64,
        key: String,
        source: String,
        #[serde(deserialize_with = "de_seq")]
        targets: Vec<String>,
        put: u64,
        remove_source: bool,
    },
    /// The copy `put` of `key` landed: its replicas become readable (and a move's source
    /// replica goes). Answered `Ok`.
    CopyEnd {
        client: u64,
        key: String,
        put: u64,
    },
}

/// A write into a segment still running, as a client reports it (`Request::HoldWrites`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteInFlight {
    /// The segment's transfer-engine name, as the put's replica named it.
    pub te_endpoint: String,
    pub addr: u64,
    pub size: u64,
    /// How much longer (ms) bytes of it may still land (a write a transfer gave up on may
    /// still be landing at the target for up to its own timeout).
    pub left_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Ok,
    Ping(PingStatus),
    Replicas(Vec<ReplicaDesc>),
    ReplicaList(ReplicaList),
    Exists(bool),
    Count(u64),
    Err(StoreError),
    Batch(#[serde(deserialize_with = "de_batch")] Vec<Response>),
    Keys(Vec<String>),
    /// To [`Request::AuthHello`], a plain frame: the master's Noise answer
    /// (`kvferry::auth::ANSWER_LEN` bytes). Last, so the other variants keep their wire
    /// numbers.
    AuthChallenge {
        answer: Vec<u8>,
    },
    /// To [`Request::OffloadBeat`]. Last, so the other variants keep their wire numbers.
    Offload(OffloadOrders),
    /// To [`Request::GetReplicaList`] when no memory replica is left but a copy on a client's
    /// disk is (a client that does not know it fails the read with a decoding error).
    DiskReplica(DiskReplicaList),
    /// To [`Request::CreateCopyTask`] and [`Request::CreateMoveTask`]. (The tasks' answers
    /// are last, so the other variants keep their wire numbers.)
    Task(TaskId),
    /// To [`Request::QueryTask`].
    TaskInfo(Box<TaskInfo>),
    /// To [`Request::FetchTasks`].
    Tasks(#[serde(deserialize_with = "de_seq")] Vec<TaskAssignment>),
    /// To [`Request::CopyStart`].
    Copy(Box<CopyPlan>),
}

/// Answer to a `GetReplicaList` served from a disk: where the copy is, under a read lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskReplicaList {
    pub disk: DiskDesc,
    pub size: u64,
    pub lease_ttl_ms: u64,
    /// As [`ReplicaList::read_id`] (released the same way; holds no memory).
    pub read_id: u64,
}

impl Response {
    pub fn into_result(self) -> StoreResult<Response> {
        match self {
            Response::Err(e) => Err(e),
            other => Ok(other),
        }
    }
}

/// Encodes a message as one frame ([`crate::frame::encode`], at most [`MAX_FRAME`]).
pub fn encode<T: Serialize>(msg: &T) -> StoreResult<Vec<u8>> {
    frame::encode(msg, MAX_FRAME).map_err(|e| match e {
        frame::EncodeError::Encode(e) => StoreError::Internal(format!("encoding: {e}")),
        frame::EncodeError::TooLarge(t) => StoreError::InvalidParams(format!(
            "message of {} bytes exceeds the {MAX_FRAME}-byte limit; split the batch",
            t.len
        )),
    })
}

/// Validates a frame length prefix ([`crate::frame::body_len`], at most [`MAX_FRAME`]).
pub fn decode_len(prefix: [u8; frame::PREFIX_LEN]) -> StoreResult<usize> {
    frame::body_len(prefix, MAX_FRAME).map_err(|t| {
        StoreError::Rpc(format!(
            "frame of {} bytes exceeds the {MAX_FRAME}-byte limit",
            t.len
        ))
    })
}

/// Decodes a frame body (an answer, on a client: its vectors are not bounded but by the
/// frame's length and [`MAX_BATCH`]; see [`decode_request`]).
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> StoreResult<T> {
    REFUSED.with(|r| r.set(None));
    frame::decode_body(body).map_err(|e| match REFUSED.with(|r| r.take()) {
        Some(Refusal::Nested) => StoreError::InvalidParams("nested batches are not allowed".into()),
        Some(Refusal::TooMany) => StoreError::InvalidParams(format!("a batch holds at most {MAX_BATCH} requests; split it")),
        Some(Refusal::TooLarge) => StoreError::InvalidParams(format!(
            "a request frame of {} bytes decodes into more than {} bytes of requests (at most {DECODE_FACTOR} times its frame, or {DECODE_ALLOWANCE} bytes): a batch of many tiny requests; split it",
            body.len(),
            decode_bound(body.len())
        )),
        None => StoreError::Rpc(format!("malformed message: {e}")),
    })
}

/// The most bytes the vectors of a request frame of `len` bytes decode into
/// ([`DECODE_ALLOWANCE`]).
pub fn decode_bound(len: usize) -> usize {
    DECODE_ALLOWANCE.max(len.saturating_mul(DECODE_FACTOR))
}

/// Decodes a request frame body, as a master does: the vectors it decodes into (the batch's
/// and those in its requests) hold at most [`decode_bound`] of its length in bytes, and grow
/// as their elements arrive (a claimed length reserves nothing); the strings in it hold at
/// most its length. So a frame of `n` bytes costs at most `n + decode_bound(n)` bytes of heap.
pub fn decode_request(body: &[u8]) -> StoreResult<Request> {
    struct Unbound;
    impl Drop for Unbound {
        fn drop(&mut self) {
            BUDGET.with(|b| b.set(None));
        }
    }
    BUDGET.with(|b| b.set(Some(decode_bound(body.len()))));
    let _unbound = Unbound;
    decode(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip() {
        let r = Request::Batch(vec![
            Request::PutStart {
                client: 7,
                key: "k".into(),
                size: 10,
                config: ReplicateConfig::default(),
                upsert: false,
                put: 3,
            },
            Request::GetReplicaList { key: "k".into() },
        ]);
        let f = encode(&r).unwrap();
        let n = decode_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, f.len() - 4);
        assert_eq!(decode::<Request>(&f[4..]).unwrap(), r);
        let e = Response::Err(StoreError::ObjectNotFound("k".into()));
        assert_eq!(decode::<Response>(&encode(&e).unwrap()[4..]).unwrap(), e);
        assert!(decode_len(u32::MAX.to_le_bytes()).is_err());
        // The authentication's messages came last: every earlier variant keeps its number.
        let first = |f: Vec<u8>| f[4];
        assert_eq!(
            first(
                encode(&Request::HoldWrites {
                    client: 0,
                    writes: vec![]
                })
                .unwrap()
            ),
            15
        );
        assert_eq!(
            first(encode(&Request::AuthHello { hello: vec![1; 16] }).unwrap()),
            16
        );
        assert_eq!(
            first(encode(&Request::AuthProof { mac: vec![2; 32] }).unwrap()),
            17
        );
        assert_eq!(
            first(encode(&Response::AuthChallenge { answer: vec![] }).unwrap()),
            9
        );
        let e = Response::Err(StoreError::Unauthorized("why".into()));
        assert_eq!(
            encode(&e).unwrap()[4..6],
            [6, 18],
            "Err, then the error's number"
        );
        assert_eq!(decode::<Response>(&encode(&e).unwrap()[4..]).unwrap(), e);
    }

    /// The disk tier's messages came last (every earlier variant keeps its number), round
    /// trip, and a beat claiming huge lists reserves nothing for the claim.
    #[test]
    fn the_disk_tiers_messages_come_last_and_decode_within_bounds() {
        let beat = Request::OffloadBeat {
            client: 3,
            beat: Box::new(OffloadBeat {
                disk: 9,
                endpoint: "h:1".into(),
                done: vec![OffloadDone {
                    task: 1,
                    key: "k".into(),
                }],
                failed: vec![2],
                evicted: vec!["e".into()],
                recovered: vec![("r".into(), 5)],
            }),
        };
        let f = encode(&beat).unwrap();
        assert_eq!(f[4], 18);
        assert_eq!(decode_request(&f[4..]).unwrap(), beat);
        let orders = Response::Offload(OffloadOrders {
            tasks: vec![OffloadTask {
                task: 1,
                key: "k".into(),
                addr: 4096,
                size: 10,
            }],
            drop: vec!["d".into()],
        });
        let f = encode(&orders).unwrap();
        assert_eq!(f[4], 10);
        assert_eq!(decode::<Response>(&f[4..]).unwrap(), orders);
        let disk = Response::DiskReplica(DiskReplicaList {
            disk: DiskDesc {
                endpoint: "h:1".into(),
                disk: 9,
                size: 10,
            },
            size: 10,
            lease_ttl_ms: 5,
            read_id: 6,
        });
        let f = encode(&disk).unwrap();
        assert_eq!(f[4], 11);
        assert_eq!(decode::<Response>(&f[4..]).unwrap(), disk);
        // A beat claiming 2^32 - 1 tasks done, and holding one byte.
        let claim = [18u8, 3, 9, 0, 0xff, 0xff, 0xff, 0xff, 0x0f, 1];
        let (r, peak) = crate::alloc_count::peak_during(|| decode_request(&claim));
        assert!(r.is_err());
        assert!(peak < 4096, "a claimed length reserved {peak} bytes");
    }

    /// The wire bytes, pinned: the length prefix (u32 little-endian), then the postcard body.
    #[test]
    fn frames_keep_their_wire_bytes() {
        assert_eq!(
            encode(&Request::Ping { client: 5 }).unwrap(),
            [2, 0, 0, 0, 3, 5]
        );
        assert_eq!(
            encode(&Request::GetReplicaList { key: "k".into() }).unwrap(),
            [3, 0, 0, 0, 7, 1, b'k']
        );
        assert_eq!(encode(&Response::Exists(true)).unwrap(), [2, 0, 0, 0, 4, 1]);
        assert_eq!(
            encode(&Response::Count(300)).unwrap(),
            [3, 0, 0, 0, 5, 0xac, 0x02]
        );
        assert_eq!(decode_len([3, 0, 0, 0]).unwrap(), 3);
        assert_eq!(
            decode::<Response>(&[5, 0xac, 0x02]).unwrap(),
            Response::Count(300)
        );
    }

    /// A frame of a hundred thousand batches nested in each other (200 KB) is refused at the
    /// second level; before, decoding it recursed until the thread's stack overflowed, which
    /// aborted the master. Nor does a batch of more than `MAX_BATCH` requests decode.
    #[test]
    fn nested_and_oversized_batches_are_refused_while_decoding() {
        let mut body = Vec::new();
        for _ in 0..100_000 {
            body.extend_from_slice(&[12, 1]); // Batch, one element
        }
        body.extend_from_slice(&[3, 0]); // Ping { client: 0 }
        let e = decode::<Request>(&body).unwrap_err();
        assert!(
            matches!(&e, StoreError::InvalidParams(w) if w.contains("nested batches")),
            "{e}"
        );
        let mut r = vec![7u8, 1]; // Response::Batch
        for _ in 0..100_000 {
            r.extend_from_slice(&[7, 1]);
        }
        assert!(decode::<Response>(&r).is_err());
        // One level is a batch as before, and the depth count is back to zero after a failure.
        let one = Request::Batch(vec![Request::Ping { client: 0 }]);
        assert_eq!(decode::<Request>(&encode(&one).unwrap()[4..]).unwrap(), one);
        let mut big = vec![12u8];
        let mut n = MAX_BATCH + 1;
        while n >= 0x80 {
            big.push((n as u8) | 0x80);
            n >>= 7;
        }
        big.push(n as u8);
        for _ in 0..=MAX_BATCH {
            big.extend_from_slice(&[3, 0]);
        }
        assert!(
            matches!(decode::<Request>(&big), Err(StoreError::InvalidParams(w)) if w.contains("at most"))
        );
    }

    /// The handshake's first frame is read without decoding: exactly an `AuthHello` and its
    /// bytes, of any length up to the longest opening message; anything else is not one.
    #[test]
    fn an_auth_hello_is_read_from_its_frame_alone() {
        for n in [0usize, 1, 48, 127, 128, 300, kvferry::auth::MAX_HELLO_LEN] {
            let hello: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let f = encode(&Request::AuthHello {
                hello: hello.clone(),
            })
            .unwrap();
            assert!(f.len() - 4 <= MAX_AUTH_HELLO_FRAME);
            assert_eq!(auth_hello_of(&f[4..]), Some(&hello[..]), "{n} bytes");
            assert_eq!(auth_hello_of(&f[4..f.len() - 1]), None, "cut short");
            let mut longer = f[4..].to_vec();
            longer.push(0);
            assert_eq!(auth_hello_of(&longer), None, "a byte more");
        }
        assert_eq!(
            encode(&Request::AuthHello {
                hello: vec![0; kvferry::auth::MAX_HELLO_LEN]
            })
            .unwrap()
            .len()
                - 4,
            MAX_AUTH_HELLO_FRAME
        );
        assert_eq!(
            auth_hello_of(&encode(&Request::AuthProof { mac: vec![1; 40] }).unwrap()[4..]),
            None
        );
        assert_eq!(
            auth_hello_of(&encode(&Request::Ping { client: 16 }).unwrap()[4..]),
            None
        );
        assert_eq!(auth_hello_of(&[]), None);
        assert_eq!(master_identity("c/"), master_identity("c"));
    }

    /// A request frame costs the master at most its length and `decode_bound` of it in heap:
    /// a frame claiming a huge vector reserves nothing for the claim, and a 2 MB batch of a
    /// million pings (128 bytes each in memory: 128 MB) is refused past 16 times its length,
    /// saying to split it. Before, the claim reserved up to 1 MiB and the batch grew to
    /// 126 MB. A batch of real requests decodes as before.
    #[test]
    fn a_small_request_frame_never_costs_a_large_allocation() {
        use crate::alloc_count::peak_during;
        // `ReleaseReads` claiming 2^32 - 1 ids, and holding one.
        let claim = [13u8, 0xff, 0xff, 0xff, 0xff, 0x0f, 1];
        let (r, peak) = peak_during(|| decode_request(&claim));
        assert!(r.is_err());
        assert!(peak < 4096, "a claimed length reserved {peak} bytes");
        let (r, peak) = peak_during(|| decode_request(&[17u8, 0xff, 0xff, 0x03, 1]));
        assert!(
            r.is_err() && peak < 4096,
            "AuthProof claiming 64 KiB: {peak} bytes"
        );
        // A million pings, two bytes each.
        let mut pings = vec![12u8];
        let mut n = MAX_BATCH;
        while n >= 0x80 {
            pings.push((n as u8) | 0x80);
            n >>= 7;
        }
        pings.push(n as u8);
        for _ in 0..MAX_BATCH {
            pings.extend_from_slice(&[3, 0]);
        }
        let (r, peak) = peak_during(|| decode_request(&pings));
        assert!(
            matches!(&r, Err(StoreError::InvalidParams(w)) if w.contains("split it")),
            "{r:?}"
        );
        assert!(
            peak <= decode_bound(pings.len()) + (1 << 20),
            "{peak} bytes for a frame of {}",
            pings.len()
        );
        assert!(peak < 40 << 20, "{peak}");
        // Real requests: a batch of 20000 puts of 12-byte keys, and one of 8000 pings.
        let puts = Request::Batch(
            (0..20_000)
                .map(|i| Request::PutStart {
                    client: u64::MAX / 3,
                    key: format!("layer-{i:06}"),
                    size: 4096,
                    config: ReplicateConfig::default(),
                    upsert: false,
                    put: i,
                })
                .collect(),
        );
        assert_eq!(decode_request(&encode(&puts).unwrap()[4..]).unwrap(), puts);
        let few = Request::Batch((0..8000).map(|_| Request::Ping { client: 0 }).collect());
        assert_eq!(decode_request(&encode(&few).unwrap()[4..]).unwrap(), few);
        let segments = Request::RemountSegments {
            client: 1,
            segments: (0..100)
                .map(|i| Segment {
                    id: i,
                    name: format!("s{i}"),
                    te_endpoint: "h:1".into(),
                    base: 0,
                    size: 1,
                })
                .collect(),
        };
        assert_eq!(
            decode_request(&encode(&segments).unwrap()[4..]).unwrap(),
            segments
        );
        // (An answer is decoded unbounded, as before: a client reads what its master sent.)
        let answers = Response::Batch(vec![Response::Ok; 100_000]);
        assert_eq!(
            decode::<Response>(&encode(&answers).unwrap()[4..]).unwrap(),
            answers
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<Request>(&b);
            let _ = decode_request(&b);
            let _ = decode::<Response>(&b);
        }
    }
}
