//! The master's RPC protocol: length-prefixed postcard messages over TCP.
//!
//! Frame: `u32` little-endian payload length, then a postcard-encoded [`Request`] or
//! [`Response`]. One request, one response, in order, per connection. [`Request::Batch`]
//! carries many operations in one round trip. The codec below is pure (sans-IO).

use crate::error::{StoreError, StoreResult};
use serde::{Deserialize, Serialize};

/// Largest frame accepted (a batch of many keys fits easily).
pub const MAX_FRAME: usize = 64 << 20;

/// The most requests (or answers) one batch holds: a 64 MiB frame of two-byte pings would
/// otherwise decode into 33 M requests (4 GB).
pub const MAX_BATCH: usize = 1 << 20;

/// Why [`de_batch`] refused a batch.
#[derive(Clone, Copy)]
enum Refusal {
    Nested,
    TooMany,
}

std::thread_local! {
    /// Batches being decoded on this thread (see [`de_batch`]).
    static BATCH_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Why [`de_batch`] refused (postcard reports a custom error without its text).
    static REFUSED: std::cell::Cell<Option<Refusal>> = const { std::cell::Cell::new(None) };
}

/// Decodes a batch's requests or answers: refuses a batch inside a batch at once (decoding
/// recurses once per level, and a frame of nested batches overflowed the connection thread's
/// stack, aborting the master) and more than [`MAX_BATCH`] elements; grows as elements
/// arrive (nothing reserved by a claimed length).
fn de_batch<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
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
    pub preferred_segments: Vec<String>,
    /// Optional object group: shared lease refresh and eviction.
    pub group_id: Option<String>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig { replica_num: 1, soft_pin: SoftPin::Preserve, soft_pin_ttl_ms: None, with_hard_pin: false, preferred_segments: Vec::new(), group_id: None }
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PingStatus {
    Ok,
    /// The master does not know this client (restarted, or TTL expired): remount.
    NeedRemount,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    MountSegment { client: u64, segment: Segment },
    RemountSegments { client: u64, segments: Vec<Segment> },
    UnmountSegment { client: u64, segment: u64 },
    Ping { client: u64 },
    /// Starts put `put` of `key`: `put` is chosen by the client, distinct among its puts (a
    /// counter), and only a `PutEnd` or `PutRevoke` naming it ends this put, so the late end
    /// of an earlier put of the key (one discarded as a zombie meanwhile) never ends a later
    /// one before its bytes landed, and a start whose answer was lost is revoked exactly.
    PutStart { client: u64, key: String, size: u64, config: ReplicateConfig, upsert: bool, put: u64 },
    PutEnd { client: u64, key: String, put: u64 },
    PutRevoke { client: u64, key: String, put: u64 },
    GetReplicaList { key: String },
    ExistKey { key: String },
    Remove { key: String, force: bool },
    RemoveAll { force: bool },
    RemoveByRegex { pattern: String, force: bool },
    /// Many operations in one round trip; answered by [`Response::Batch`] in the same order.
    Batch(#[serde(deserialize_with = "de_batch")] Vec<Request>),
    /// The reads named (`ReplicaList::read_id`) finished: their replicas may be reclaimed.
    /// Clients send it piggybacked on their next request (or with their next ping). Last, so
    /// the other variants keep their wire numbers.
    ReleaseReads { ids: Vec<u64> },
    /// Mooncake's `BatchReplicaClear`: drops the replicas of `keys` this client wrote whose
    /// lease ended, on `segment` (a segment name) or everywhere (empty); answered by
    /// [`Response::Keys`] with the keys cleared.
    BatchReplicaClear { client: u64, keys: Vec<String>, segment: String },
    /// Writes of this client still running (kvferry's; last, so the other variants keep their
    /// wire numbers): sent after a master answered that it did not know the client (it
    /// restarted without HA, so it knows nothing of the writes its predecessor placed). The
    /// master places nothing new in their segments until they are over, and drops the
    /// replicas it placed in their ranges since. Answered `Ok`.
    HoldWrites { client: u64, writes: Vec<WriteInFlight> },
    /// The first request of a connection to a master that holds the cluster key
    /// (`KVFERRY_AUTH_KEY_FILE`, `kvferry::auth`): the client's fresh nonce. Answered by
    /// [`Response::AuthChallenge`]; a master without a key refuses it
    /// ([`StoreError::Unauthorized`]). Last, so the other variants keep their wire numbers.
    AuthHello { nonce: Vec<u8> },
    /// The client's MAC over both nonces ([`AUTH`]), after the master proved the key;
    /// answered `Ok`, after which the connection carries requests.
    AuthProof { mac: Vec<u8> },
}

/// The store's cluster-key exchange (`kvferry::auth`): the client opens it, the master answers.
pub const AUTH: kvferry::auth::Exchange = kvferry::auth::Exchange { opener: "kvferry-store/client", answerer: "kvferry-store/master" };

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
    /// To [`Request::AuthHello`]: the master's nonce and its MAC over both ([`AUTH`]).
    /// Last, so the other variants keep their wire numbers.
    AuthChallenge { nonce: Vec<u8>, mac: Vec<u8> },
}

impl Response {
    pub fn into_result(self) -> StoreResult<Response> {
        match self {
            Response::Err(e) => Err(e),
            other => Ok(other),
        }
    }
}

/// Encodes a message as one frame.
pub fn encode<T: Serialize>(msg: &T) -> StoreResult<Vec<u8>> {
    let body = postcard::to_stdvec(msg).map_err(|e| StoreError::Internal(format!("encoding: {e}")))?;
    if body.len() > MAX_FRAME {
        return Err(StoreError::InvalidParams(format!("message of {} bytes exceeds the {MAX_FRAME}-byte limit; split the batch", body.len())));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Validates a frame length prefix.
pub fn decode_len(prefix: [u8; 4]) -> StoreResult<usize> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(StoreError::Rpc(format!("frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")));
    }
    Ok(n)
}

/// Decodes a frame body.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> StoreResult<T> {
    REFUSED.with(|r| r.set(None));
    postcard::from_bytes(body).map_err(|e| match REFUSED.with(|r| r.take()) {
        Some(Refusal::Nested) => StoreError::InvalidParams("nested batches are not allowed".into()),
        Some(Refusal::TooMany) => StoreError::InvalidParams(format!("a batch holds at most {MAX_BATCH} requests; split it")),
        None => StoreError::Rpc(format!("malformed message: {e}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip() {
        let r = Request::Batch(vec![
            Request::PutStart { client: 7, key: "k".into(), size: 10, config: ReplicateConfig::default(), upsert: false, put: 3 },
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
        assert_eq!(first(encode(&Request::HoldWrites { client: 0, writes: vec![] }).unwrap()), 15);
        assert_eq!(first(encode(&Request::AuthHello { nonce: vec![1; 16] }).unwrap()), 16);
        assert_eq!(first(encode(&Request::AuthProof { mac: vec![2; 32] }).unwrap()), 17);
        assert_eq!(first(encode(&Response::AuthChallenge { nonce: vec![], mac: vec![] }).unwrap()), 9);
        let e = Response::Err(StoreError::Unauthorized("why".into()));
        assert_eq!(encode(&e).unwrap()[4..6], [6, 18], "Err, then the error's number");
        assert_eq!(decode::<Response>(&encode(&e).unwrap()[4..]).unwrap(), e);
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
        assert!(matches!(&e, StoreError::InvalidParams(w) if w.contains("nested batches")), "{e}");
        let mut r = vec![10u8, 1]; // Response::Batch
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
        assert!(matches!(decode::<Request>(&big), Err(StoreError::InvalidParams(w)) if w.contains("at most")));
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<Request>(&b);
            let _ = decode::<Response>(&b);
        }
    }
}
