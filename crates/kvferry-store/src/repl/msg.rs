//! The messages of a replication link (leader → standby, standby → leader), as the machines
//! take and make them; the drivers frame, seal and move them (`crate::ha::sync`'s
//! `encode_frame`, `crate::ha::link`, `crate::ha::standby`). Their wire numbers are fixed:
//! new variants go last.

use crate::master::changes::Change;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Leader → standby.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToStandby {
    /// The first frame: the cluster, and the leader's term (its view key's create revision)
    /// and lease.
    Hello {
        cluster_id: String,
        term: i64,
        lease: i64,
        leader: String,
    },
    /// Part of the state after entry `seq`; the one with `last` ends the image.
    Image {
        seq: u64,
        changes: Vec<Change>,
        last: bool,
    },
    /// The changes of entry `seq`, applied after every earlier one.
    Entry { seq: u64, changes: Vec<Change> },
    /// Where the leader's etcd journal is, or is about to be, whole: a standby keeps the
    /// entries after it for a takeover ([`super::MirrorTail`]). `written`: it is whole up to entry
    /// `seq` now (sent when the in-sync set becomes non-empty, right after entry `seq`, and
    /// once a background snapshot's head at `seq` is written: the runs from elsewhere are of
    /// no use any more). Not `written`: a background snapshot of the state after entry `seq`
    /// is being written (sent right after entry `seq`): a run starts there, and the current
    /// one is kept until the snapshot's head is. Sent only to standbys whose registration
    /// says they take it (`crate::ha::sync::registration`'s `RUNS`): one of an earlier version would not
    /// decode it.
    Base { seq: u64, written: bool },
    /// To a standby that links while others are in sync (its image is after where the etcd
    /// journal is whole, `base`): the entries from there up to its image's position, as the
    /// leader sent them to the others (each the frame of the log's entries `first..=last`),
    /// in one or more of these frames (`crate::ha::link::run_frames`, each continuing the one before) right
    /// after its image. Kept for a takeover, not applied (the image holds them): its run
    /// starts at `base`, as the others' did, once they reach its image. Only to a standby that
    /// takes [`ToStandby::Base`].
    Run { base: u64, frames: Vec<KeptFrame> },
    /// The first frame where the masters hold a cluster key, a plain one: the leader's Noise
    /// opening message (`crate::ha::sync::HA_LINK`, dialing `crate::ha::sync::standby_identity`), answered by
    /// [`ToLeader::AuthChallenge`]. Last, so the other variants keep their wire numbers.
    AuthHello { hello: Vec<u8> },
    /// Not sent (it kept the number of an earlier exchange's step): refused wherever it comes.
    AuthProof { mac: Vec<u8> },
}

/// One entry's frame in a [`ToStandby::Run`]: the log's entries `first..=last`, the frame as
/// `crate::ha::sync::encode_frame` made it (a byte string to serde, not a sequence of numbers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptFrame {
    pub first: u64,
    pub last: u64,
    pub frame: bytes::Bytes,
}

impl From<KeptFrame> for (u64, u64, Arc<Vec<u8>>) {
    /// A received run's frame as the mirror's tail keeps it ([`super::MirrorTail::joined`]).
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
