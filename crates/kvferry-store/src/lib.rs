//! kvferry Store: a cluster-wide memory pool for KV-cache objects.
//!
//! A **master** ([`master`], served by [`server`]) holds metadata only: which clients
//! contributed which memory segments, which object has replicas where, leases, pins,
//! eviction. **Clients** ([`client`]) contribute segments and move object bytes among
//! themselves with the kvferry transfer engine; data never passes through the master.
//!
//! This crate is not the transfer engine (that is `kvferry`), and it does not speak Mooncake's
//! master protocol (coro_rpc/struct_pack): its RPC is its own ([`proto`]), chosen for a small
//! auditable codec. Mooncake compatibility is at the client API (`MooncakeDistributedStore` in
//! the Python package) and at the transfer-engine wire level.

pub mod cleanup;
pub mod client;
pub mod error;
pub mod ha;
pub mod master;
pub mod proto;
pub mod server;

pub use client::{Client, ClientConfig, Staged};
pub use error::{StoreError, StoreResult};
pub use master::{Master, MasterConfig, Strategy};
pub use proto::{ReplicateConfig, SoftPin};
