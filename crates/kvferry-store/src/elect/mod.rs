//! The election as machines without I/O: the campaign for the leader's key ([`Campaign`]),
//! the fence that says whether a leader may answer and its lease renewals ([`fence`]), and the
//! in-sync record's rules on who may lead ([`insync`]). Time comes in as milliseconds on the
//! driver's clock; etcd is reached only through what the machines ask for ([`Op`]), carried
//! out against an [`Etcd`] by [`Campaign::execute`]: the real client in the HA layer's
//! elector thread (`crate::ha`), a model of etcd in the simulator (`crate::sim::election`).
//! `boundaries.rs` checks that nothing here names a driver, the clock, a thread or a lock.

mod campaign;
pub mod fence;
pub mod insync;

pub use campaign::{Answer, Campaign, Config, Etcd, Op, Out, Plan, View};

#[cfg(test)]
mod tests;
