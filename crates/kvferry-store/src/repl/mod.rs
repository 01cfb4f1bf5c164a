//! Replication's bookkeeping as machines without I/O: the leader's journal [`Queue`]
//! (tickets, what is durable, the answers waiting, grants), the [`Pipeline`] of entries
//! streamed to the in-sync standbys and released by their acknowledgements, a standby's
//! [`Feed`] (which connection feeds its mirror, which frame comes next, what it
//! acknowledges), the link's messages ([`ToStandby`], [`ToLeader`]), and the entries the etcd
//! journal lacks while standbys are in sync ([`Tail`], [`MirrorTail`]), the etcd journal's
//! writer: its keys, positions, sizes, snapshots and compaction ([`JournalWriter`]), and the
//! leader's standbys ([`Roster`]: polls, links to open and drop, retries, who joins and
//! leaves the in-sync set, what a stopping leader does first, where a rebase writes from).
//!
//! They read no clock (time is microseconds on the driver's monotonic clock, passed in),
//! take no lock, start no thread and touch no socket or etcd: the HA drivers
//! (`crate::ha::journal`'s `JournalCore`, `Release` and `Writer`, `crate::ha::sync`'s
//! mirror) hold them under their locks and act on what they answer; the simulator
//! (`crate::sim`) and the unit tests below drive them directly. `crate::boundaries` fails
//! when a file here names a driver, the clock, a lock or a thread.

mod feed;
pub mod members;
mod msg;
mod pipeline;
mod queue;
pub mod roster;
mod tail;
pub mod writer;

pub use feed::Feed;
pub use msg::{KeptFrame, ToLeader, ToStandby};
pub use pipeline::{Pipeline, Released};
pub use queue::{Outcome, Queue, Written};
pub use roster::Roster;
pub use tail::{tail_after, MirrorTail, Run, Tail, TailFrame, Takeover};
pub use writer::{Head, JournalWriter, Txn};

#[cfg(test)]
mod tests;
