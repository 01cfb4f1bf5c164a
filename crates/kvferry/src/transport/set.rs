//! The engine's transports, assembled: the one place that names them. It builds each (TCP
//! and shared memory always, RDMA as `KVFERRY_TRANSPORT` and the host allow, the own
//! segment's copy, the staging decorators), hands each the engine's [`PeerDirectory`] at
//! construction, and writes the preference order per mode as data: the ranks of the
//! [`Router`]. The engine uses the transports only through the trait (`all`), the router,
//! and [`Diag`] (what `kvferry doctor`, tests and `segment_transport` report).

use super::local::LocalTransport;
use super::rdma::{RdmaOptions, RdmaTransport, RdmaUsage};
use super::shm::{ShmOptions, ShmTransport, TransportMode};
use super::tcp::{TcpOptions, TcpTransport};
use super::{Kinds, Mem, Peer, PeerDirectory, Transport};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gpu::stage::{StagedTransport, Stager};
use crate::memory::MemoryRegistry;
use crate::route::Router;
use std::net::TcpListener;
use std::sync::Arc;

/// What the transports are built from.
pub(crate) struct Build<'a> {
    pub config: &'a Config,
    /// This engine's segment name.
    pub name: &'a str,
    /// The advertised host (published as the TCP data host).
    pub host: &'a str,
    /// The TCP data listener, bound.
    pub data_listener: TcpListener,
    pub memory: Arc<MemoryRegistry>,
    /// The cluster key (`KVFERRY_AUTH_KEY_FILE`).
    pub auth: Option<Arc<crate::auth::ClusterKey>>,
    /// Segments are published in a metadata service (else names are handshake addresses).
    pub central: bool,
}

/// The engine's transports.
pub(crate) struct TransportSet {
    /// Every transport, in the order they hear of registrations, describe the segment and
    /// shut down (the staging decorators are not among them: they wrap these).
    pub all: Vec<Arc<dyn Transport>>,
    /// Which carries each piece.
    pub router: Router,
    /// Diagnostics the router never uses.
    pub diag: Diag,
}

/// What the engine reports about its transports (data port, usage, why a peer is not reached
/// through shared memory); never used to route.
pub(crate) struct Diag {
    tcp: Arc<TcpTransport>,
    shm: Arc<ShmTransport>,
    rdma: Option<Arc<RdmaTransport>>,
}

impl Diag {
    /// The TCP data port.
    pub(crate) fn data_port(&self) -> u16 {
        self.tcp.data_port()
    }

    /// TCP peers with open lanes, and connections the data server is serving.
    pub(crate) fn tcp_usage(&self) -> (usize, usize) {
        self.tcp.usage()
    }

    /// With RDMA: what it holds.
    pub(crate) fn rdma_usage(&self) -> Option<RdmaUsage> {
        self.rdma.as_ref().map(|t| t.usage())
    }

    /// Why shared memory does not serve `peer`, when `chosen` (the transport serving it) is
    /// not shared memory; `None` for the engine's own segment.
    pub(crate) fn why_not_same_host(
        &self,
        peer: &Arc<Peer>,
        chosen: &Arc<dyn Transport>,
    ) -> Option<String> {
        if peer.is_own() || std::ptr::addr_eq(Arc::as_ptr(chosen), Arc::as_ptr(&self.shm)) {
            return None;
        }
        self.shm.reachable(peer).err()
    }
}

impl TransportSet {
    /// Builds the transports `b.config` asks for, each handed `dir`.
    pub(crate) fn build(b: Build<'_>, dir: Arc<dyn PeerDirectory>) -> Result<TransportSet> {
        let config = b.config;
        let tcp = TcpTransport::new(
            b.data_listener,
            Arc::clone(&b.memory),
            TcpOptions {
                lanes: config.tcp_lanes,
                split_bytes: config.tcp_split_bytes,
                max_proto: config.tcp_proto,
                connect_timeout: config.handshake_connect_timeout,
                advertised_host: b.host.to_string(),
                inline_max: config.tcp_split_bytes,
                spin: config.spin,
                idle: config.tcp_idle,
                auth: b.auth.clone().map(|key| {
                    Arc::new(crate::auth::Keyed {
                        key,
                        names: vec![b.name.to_string()],
                    })
                }),
                protect: config.auth_protect,
            },
            config.transfer_timeout,
            Arc::clone(&dir),
        )
        .map_err(|e| Error::io("starting the TCP data server", e))?;
        let shm = Arc::new(ShmTransport::new(
            ShmOptions {
                name: b.name.to_string(),
                mode: config.transport,
                threads: config.shm_threads,
                background_fill: config.shm_background_fill,
            },
            Arc::clone(&dir),
        ));
        let rdma = rdma(config, b.name, b.central, &dir)?;
        let local: Arc<dyn Transport> = Arc::new(LocalTransport::new(Arc::clone(&b.memory)));
        let tcp_t: Arc<dyn Transport> = Arc::clone(&tcp) as _;
        let shm_t: Arc<dyn Transport> = Arc::clone(&shm) as _;
        let rdma_t: Option<Arc<dyn Transport>> = rdma.clone().map(|r| r as _);
        let mut all = vec![Arc::clone(&tcp_t), Arc::clone(&shm_t)];
        all.extend(rdma_t.clone());
        all.push(Arc::clone(&local));
        let router = ranks(config.transport, &local, &tcp_t, &shm_t, rdma_t.as_ref());
        Ok(TransportSet {
            all,
            router,
            diag: Diag { tcp, shm, rdma },
        })
    }
}

/// The preference order of `mode`, as ranks of the router (each transport tried for what it
/// declares, narrowed as written here):
///
/// - `auto`: the own segment's copy; RDMA for GPU memory on either side (GPUDirect, never
///   staged: what the NICs reach as it is); shared memory (host to host memory, anything to
///   the peer's GPU memory by CUDA IPC); RDMA for host memory; staged over the own copy, over
///   shared memory (to host memory only: GPU to GPU memory it moves unstaged or not at all)
///   and over TCP; TCP.
/// - `tcp`: the own copy, TCP, staged over each.
/// - `shm`: the own copy, shared memory, staged over each (to host memory); nothing reaches a
///   peer's GPU memory that it does not export through CUDA IPC.
/// - `rdma`: the own copy; RDMA for GPU memory, then for host memory; staged over the own
///   copy; TCP for what lies in a peer's GPU memory that RDMA does not carry as it is (staged
///   on whichever side it is GPU memory).
///
/// Staging wraps only the transports whose [`super::Caps::stageable`] holds (not RDMA: its
/// NICs reach only registered memory, which bounce buffers are not).
fn ranks(
    mode: TransportMode,
    local: &Arc<dyn Transport>,
    tcp: &Arc<dyn Transport>,
    shm: &Arc<dyn Transport>,
    rdma: Option<&Arc<dyn Transport>>,
) -> Router {
    let stager = Arc::new(Stager::default());
    let staged = |t: &Arc<dyn Transport>| -> Arc<dyn Transport> {
        debug_assert!(t.caps().stageable);
        Arc::new(StagedTransport::new(Arc::clone(t), Arc::clone(&stager)))
    };
    let to_host = Kinds::remote(Mem::Host);
    let to_gpu = Kinds::remote(Mem::Gpu);
    let mut r = Router::new((mode == TransportMode::Shm).then_some("KVFERRY_TRANSPORT=shm"))
        .rank(local, Kinds::ALL);
    match mode {
        TransportMode::Auto => {
            if let Some(rdma) = rdma {
                r = r.rank(rdma, Kinds::GPU);
            }
            r = r.rank(shm, Kinds::ALL);
            if let Some(rdma) = rdma {
                r = r.rank(rdma, Kinds::HOST);
            }
            r.rank(&staged(local), Kinds::ALL)
                .rank(&staged(shm), to_host)
                .rank(tcp, Kinds::ALL)
                .rank(&staged(tcp), Kinds::ALL)
        }
        TransportMode::Tcp => r
            .rank(tcp, Kinds::ALL)
            .rank(&staged(local), Kinds::ALL)
            .rank(&staged(tcp), Kinds::ALL),
        TransportMode::Shm => r
            .rank(shm, Kinds::ALL)
            .rank(&staged(local), Kinds::ALL)
            .rank(&staged(shm), to_host),
        TransportMode::Rdma => {
            if let Some(rdma) = rdma {
                r = r.rank(rdma, Kinds::GPU).rank(rdma, Kinds::HOST);
            }
            r.rank(&staged(local), Kinds::ALL)
                .rank(tcp, to_gpu)
                .rank(&staged(tcp), to_gpu)
        }
    }
}

/// The RDMA transport `config` asks for: required with `KVFERRY_TRANSPORT=rdma` (the engine
/// fails to start without it), with `auto` when this host has an active NIC (said once).
fn rdma(
    config: &Config,
    name: &str,
    central: bool,
    dir: &Arc<dyn PeerDirectory>,
) -> Result<Option<Arc<RdmaTransport>>> {
    let opts = |required: bool| RdmaOptions {
        segment: name.to_string(),
        devices: config.rdma_devices.clone(),
        gid_index: config.gid_index,
        max_endpoints: config.rdma_max_endpoints,
        max_passive_qps: config.rdma_max_passive_qps,
        required,
        retry_cnt: config.rdma_retry_cnt,
        gpu_rdma: config.gpu_rdma,
        topo: config.rdma_topo.clone(),
        names_are_addresses: !central,
    };
    let dir = || Arc::clone(dir);
    Ok(match config.transport {
        TransportMode::Rdma => Some(Arc::new(
            RdmaTransport::new(opts(true), dir())
                .map_err(|why| Error::Config(format!("KVFERRY_TRANSPORT=rdma, but {why}")))?,
        )),
        // RDMA when this host has an active NIC (peers without RDMA get TCP); said once.
        TransportMode::Auto if !config.auto_rdma => {
            tracing::info!("KVFERRY_TRANSPORT=auto without RDMA (KVFERRY_AUTO_RDMA=0 or MC_FORCE_TCP=1): TCP and shared memory carry transfers");
            None
        }
        TransportMode::Auto if config.rdma_forced => match RdmaTransport::new(opts(false), dir()) {
            Ok(t) => Some(Arc::new(t)),
            Err(why) => {
                return Err(Error::Config(format!(
                "KVFERRY_AUTO_RDMA=force (or Mooncake's MC_FORCE_HCA=1) asks for RDMA, but {why}"
            )))
            }
        },
        TransportMode::Auto => match crate::nic::probe().why_not() {
            Some(why) => {
                tracing::info!("KVFERRY_TRANSPORT=auto: no RDMA ({why}); TCP and shared memory carry transfers");
                None
            }
            None => match RdmaTransport::new(opts(false), dir()) {
                Ok(t) => Some(Arc::new(t)),
                Err(why) => {
                    tracing::warn!("KVFERRY_TRANSPORT=auto: RDMA NICs are present but not usable ({why}); TCP and shared memory carry transfers");
                    None
                }
            },
        },
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Caps, Needs, Piece, Prelude, Reach};
    use crate::wire::descriptor::SegmentDesc;

    /// A transport that only declares.
    struct Declares(&'static str, Caps);

    impl Transport for Declares {
        fn name(&self) -> &'static str {
            self.0
        }
        fn caps(&self) -> Caps {
            self.1
        }
        fn describe(&self, _desc: &mut SegmentDesc, _prelude: Prelude) {}
        fn reachable(&self, _peer: &Arc<Peer>) -> std::result::Result<(), String> {
            Ok(())
        }
        fn submit(&self, _peer: &Arc<Peer>, _pieces: Vec<Piece>, _inline: bool) {}
        fn shutdown(&self) {}
    }

    fn declares(
        name: &'static str,
        kinds: Kinds,
        reach: Reach,
        stageable: bool,
    ) -> Arc<dyn Transport> {
        Arc::new(Declares(
            name,
            Caps {
                kinds,
                reach,
                needs: Needs::Nothing,
                stageable,
            },
        ))
    }

    /// Each mode's ranks: (name, kinds, own segment), with the declarations of the real
    /// transports (`caps` of local.rs, tcp, shm, rdma).
    fn table(mode: TransportMode, with_rdma: bool) -> Vec<(&'static str, Kinds, bool)> {
        let host = Kinds::local(Mem::Host);
        let local = declares("local", host, Reach::Own, true);
        let tcp = declares("tcp", host, Reach::AnyHost, true);
        let shm = declares(
            "shm",
            Kinds::HOST.or(Kinds::remote(Mem::Gpu)),
            Reach::SameHost,
            true,
        );
        let rdma = declares("rdma", Kinds::ALL, Reach::AnyHost, false);
        let r = ranks(mode, &local, &tcp, &shm, with_rdma.then_some(&rdma));
        r.ranks().collect()
    }

    #[test]
    fn each_mode_writes_its_preference_order_as_ranks() {
        use Mem::{Gpu, Host};
        let gpu_local = Kinds::local(Gpu);
        let g2h = Kinds::pair(Gpu, Host);
        let host = Kinds::local(Host);
        let shm = Kinds::HOST.or(Kinds::remote(Gpu));
        assert_eq!(
            table(TransportMode::Auto, true),
            [
                ("local", host, true),
                ("rdma", Kinds::GPU, false),
                ("shm", shm, false),
                ("rdma", Kinds::HOST, false),
                ("local", gpu_local, true),
                ("shm", g2h, false),
                ("tcp", host, false),
                ("tcp", gpu_local, false),
            ]
        );
        assert_eq!(
            table(TransportMode::Auto, false),
            [
                ("local", host, true),
                ("shm", shm, false),
                ("local", gpu_local, true),
                ("shm", g2h, false),
                ("tcp", host, false),
                ("tcp", gpu_local, false),
            ]
        );
        assert_eq!(
            table(TransportMode::Tcp, false),
            [
                ("local", host, true),
                ("tcp", host, false),
                ("local", gpu_local, true),
                ("tcp", gpu_local, false),
            ]
        );
        assert_eq!(
            table(TransportMode::Shm, false),
            [
                ("local", host, true),
                ("shm", shm, false),
                ("local", gpu_local, true),
                ("shm", g2h, false),
            ]
        );
        assert_eq!(
            table(TransportMode::Rdma, true),
            [
                ("local", host, true),
                ("rdma", Kinds::GPU, false),
                ("rdma", Kinds::HOST, false),
                ("local", gpu_local, true),
                ("tcp", Kinds::pair(Host, Gpu), false),
                ("tcp", Kinds::pair(Gpu, Gpu), false),
            ]
        );
    }
}
