//! One typed configuration, read once from the environment.
//!
//! kvferry's own variables are `KVFERRY_*`. Where Mooncake has a variable with the same
//! meaning, its `MC_*` name is honoured as an alias (the `KVFERRY_*` name wins when both are
//! set). [`ENV_VARS`] lists every variable kvferry reads (the engine's, then those only the
//! `kvferry` command or the Python package read); docs/INSTALL.md's configuration table
//! gives the same facts, and `kvferry doctor` prints the values in force. Test-only variables
//! (`KVFERRY_TEST_*`, `KVFERRY_SIM_*`, `KVFERRY_SKIP_*`) are not in it: docs/INSTALL.md names
//! them as such.

use crate::error::{Error, Result};
pub use crate::transport::shm::TransportMode;
use std::net::IpAddr;
use std::time::Duration;

/// One environment variable the engine reads.
#[derive(Debug, Clone, Copy)]
pub struct EnvVar {
    pub name: &'static str,
    /// Mooncake's names with the same meaning.
    pub aliases: &'static [&'static str],
    pub default: &'static str,
    pub doc: &'static str,
}

/// Every variable kvferry reads: first those [`Config::from_env`] reads (it looks up only
/// these entries, by name and alias), then those only the `kvferry` command or the Python
/// package read (their `doc` says which).
pub const ENV_VARS: &[EnvVar] = &[
    EnvVar { name: "KVFERRY_MIN_PORT", aliases: &["MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"], default: "15000", doc: "lowest port picked at random for the handshake (RPC) and TCP data listeners" },
    EnvVar { name: "KVFERRY_MAX_PORT", aliases: &["MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"], default: "17000", doc: "highest port picked at random for the listeners" },
    EnvVar { name: "KVFERRY_BIND_ADDRESS", aliases: &[], default: "the advertised address", doc: "address the listeners bind; `0.0.0.0` or `::` exposes registered memory on every interface" },
    EnvVar { name: "KVFERRY_TRANSFER_TIMEOUT", aliases: &["MC_TRANSFER_TIMEOUT"], default: "30", doc: "seconds before an unfinished request becomes TIMEOUT (sync Python calls add 1 ns per byte)" },
    EnvVar { name: "KVFERRY_TCP_LANES", aliases: &["MC_TCP_LANES_PER_PEER"], default: "2", doc: "persistent TCP connections per peer (1-16)" },
    EnvVar { name: "KVFERRY_TCP_SPLIT_BYTES", aliases: &[], default: "4194304", doc: "requests larger than this are split across lanes in pieces of about this size" },
    EnvVar { name: "KVFERRY_SPIN_US", aliases: &[], default: "50", doc: "a lone small synchronous request polls for its answer this many microseconds before sleeping (0: never poll); bounded, never a busy loop" },
    EnvVar { name: "KVFERRY_TCP_IDLE_MS", aliases: &[], default: "5000", doc: "a TCP lane (connection and its two threads) unused this long is closed and its threads end; the next request reconnects. Bounds what a departed peer costs (10-3600000)" },
    EnvVar { name: "KVFERRY_TCP_PROTO", aliases: &["MC_TCP_PROTO"], default: "2", doc: "`1` forces Mooncake's legacy v1 TCP framing towards every peer (writes are then confirmed by a read fence)" },
    EnvVar { name: "KVFERRY_HANDSHAKE_MAX_LENGTH", aliases: &["MC_HANDSHAKE_MAX_LENGTH"], default: "1048576", doc: "largest handshake frame accepted (bytes, up to 128 MiB)" },
    EnvVar { name: "KVFERRY_HANDSHAKE_CONNECT_TIMEOUT", aliases: &["MC_HANDSHAKE_CONNECT_TIMEOUT"], default: "5", doc: "seconds to connect to a peer's handshake port" },
    EnvVar { name: "KVFERRY_METADATA_SERVER", aliases: &[], default: "P2PHANDSHAKE", doc: "where segments are found: `P2PHANDSHAKE` (peers exchange descriptors directly), `http(s)://host:port/metadata`, `etcd://h1:2379,h2:2379` (a bare `host:port` means etcd) or `redis://[user:pass@]host:port[/db]`; `kvferry master --enable-metadata-cleanup-on-timeout` removes the entries of clients it dropped from this service" },
    EnvVar { name: "KVFERRY_METADATA_CLUSTER_ID", aliases: &["MC_METADATA_CLUSTER_ID"], default: "(none)", doc: "namespace in the metadata service: keys become `mooncake/<id>/...` instead of `mooncake/...`" },
    EnvVar { name: "KVFERRY_METADATA_TIMEOUT", aliases: &[], default: "3", doc: "seconds one metadata request may take (connect: half of it, at most 1.5 s)" },
    EnvVar { name: "KVFERRY_METADATA_CA_FILE", aliases: &[], default: "(built-in Mozilla roots)", doc: "`https://` metadata server: PEM file of the CA certificate(s) to trust instead of the built-in public roots (a private CA or a self-signed server certificate; `/etc/ssl/certs/ca-certificates.crt` trusts the system store)" },
    EnvVar { name: "KVFERRY_METADATA_HTTP_TOKEN", aliases: &["MC_METADATA_HTTP_TOKEN"], default: "(none: no token, as Mooncake)", doc: "a shared token for `http(s)://` metadata servers, as Mooncake 0.3.14's: engines and store clients send `Authorization: Bearer <token>` with every request, and `kvferry metadata-server` and `kvferry master --enable-http-metadata-server` answer requests to `/metadata` without it (or with another) 401 `unauthorized` (`/health` stays open). Set the same value on the server and on every engine, kvferry's and Mooncake's; `kvferry doctor` shows only its length" },
    EnvVar { name: "KVFERRY_METADATA_LEASE_TTL", aliases: &[], default: "10", doc: "seconds an engine's etcd entries outlive it when it stops renewing them (crash); the engine renews and re-checks its entries every third of this" },
    EnvVar { name: "KVFERRY_ADVERTISE_ADDRESS", aliases: &["MC_TCP_BIND_ADDRESS"], default: "the host part of local_hostname", doc: "central metadata mode: the address of this host published in `rpc_meta` and bound by the listeners, when local_hostname is a logical name (e.g. `prefill-0`)" },
    EnvVar { name: "KVFERRY_REDIS_USERNAME", aliases: &["MC_REDIS_USERNAME"], default: "(none)", doc: "Redis user for `AUTH` (the `redis://user:pass@` URL form wins)" },
    EnvVar { name: "KVFERRY_REDIS_PASSWORD", aliases: &["MC_REDIS_PASSWORD"], default: "(none)", doc: "Redis password for `AUTH` (the URL form wins)" },
    EnvVar { name: "KVFERRY_REDIS_DB_INDEX", aliases: &["MC_REDIS_DB_INDEX"], default: "0", doc: "Redis database (0-255; the `redis://host:port/db` URL form wins)" },
    EnvVar { name: "KVFERRY_TRANSPORT", aliases: &[], default: "auto", doc: "data path to peers: `auto` (shared memory to kvferry peers on this host that allow it: their kvferry-allocated memory mapped, other memory by cross-memory attach; TCP otherwise), `tcp` (never shared memory; this engine then also offers none), `shm` (shared memory only; requests to other peers fail with the reason), `rdma` (one-sided RDMA verbs only: the engine does not start without a usable NIC, requests to peers without RDMA fail with the reason). With `auto`, a host with an active RDMA NIC also sends over RDMA to peers that publish RDMA devices (why not, logged once per peer); it still publishes a TCP descriptor, so peers reach it over TCP (a stock Mooncake TCP engine cannot reach one that publishes `rdma`). Set, it wins over the `protocol` argument of Mooncake's `initialize` (whose `rdma` means `rdma` here)" },
    EnvVar { name: "KVFERRY_RDMA_DEVICES", aliases: &["MC_TE_FILTERS"], default: "every device with an active port", doc: "RDMA: comma-separated device names to use (e.g. `mlx5_0,mlx5_1`); with a `device_name` given to Mooncake's `initialize` too, the devices both name" },
    EnvVar { name: "KVFERRY_RDMA_MAX_PASSIVE_QPS", aliases: &[], default: "16384", doc: "RDMA: queue pairs this engine makes for peers that connect to it, all peers together; a connection beyond it is refused (the peer's error says so), never a live pair closed; those of peers found gone are released (1-1048576)" },
    EnvVar { name: "KVFERRY_RDMA_MAX_ENDPOINTS", aliases: &[], default: "256", doc: "RDMA: connected endpoints (queue pairs to one peer NIC from one local NIC) this engine keeps; beyond it the least recently used idle one is closed (never one with work requests in flight) and reconnected on next use (1-65536)" },
    EnvVar { name: "KVFERRY_AUTO_RDMA", aliases: &[], default: "1", doc: "with KVFERRY_TRANSPORT=auto: whether RDMA is used at all on a host with a usable port (0/false: never, shared memory and TCP only; `force`: the engine does not start when RDMA cannot be opened, and says why, instead of going on without it). Mooncake's MC_FORCE_TCP=1 (or true/yes) means 0, and its MC_FORCE_HCA=1 means `force`, when this variable is not set (MC_FORCE_TCP wins)" },
    EnvVar { name: "KVFERRY_RDMA_TOPO", aliases: &["MC_CUSTOM_TOPO_JSON"], default: "discovered from sysfs", doc: "RDMA: a JSON file with the NIC priority matrix to use instead of discovery: `{\"cpu:0\": [[\"mlx5_0\"], [\"mlx5_1\"]], \"cuda:0\": [[\"mlx5_1\"], []]}` (location -> [preferred NICs, available NICs]); a piece is striped over its local memory's preferred NICs (else the available ones, else all). Discovery: NICs on a location's NUMA node, and for a GPU the nearest on PCIe" },
    EnvVar { name: "KVFERRY_RDMA_RETRY_CNT", aliases: &[], default: "7", doc: "RDMA: transport retries of a queue pair (each after the 67 ms ACK timeout) before a work request fails with IBV_WC_RETRY_EXC_ERR and its slice is retried on another NIC pair (0-7; Soft-RoCE treats 7 as retrying forever, so a vanished peer QP then stalls until the deadline)" },
    EnvVar { name: "KVFERRY_GPU_RDMA", aliases: &[], default: "auto", doc: "RDMA: how GPU memory is registered with the NICs (GPUDirect RDMA): `auto` (DMA-BUF where the driver, GPU, rdma-core and NIC support it, else nvidia-peermem where its kernel module is loaded, else GPU memory is staged through host memory over TCP, saying why), `dmabuf` or `peermem` (only that one; a failure is an error naming the cause). Mooncake's WITH_NVIDIA_PEERMEM=1 (on/true) means `peermem`, any other value `dmabuf`, when this variable is not set" },
    EnvVar { name: "KVFERRY_GID_INDEX", aliases: &["MC_GID_INDEX"], default: "automatic (RoCE v2, IPv4-mapped first)", doc: "RDMA: GID index to use on every NIC; an index that does not exist is an error, never silently replaced" },
    EnvVar { name: "KVFERRY_SHM_THREADS", aliases: &[], default: "CPUs, at most 4", doc: "threads copying queued shared-memory requests (requests over 1 MiB are cut into 1 MiB pieces spread over them; 1-64)" },
    EnvVar { name: "KVFERRY_SHM_BACKGROUND_FILL_MB", aliases: &[], default: "4096", doc: "same-host peers' buffers whose owner allocated every page (store segments): MiB of them per engine whose page tables a helper thread fills in the background, from 2 s after the buffer is mapped, on a `SCHED_IDLE` thread (only CPU nothing else wants) and at most a quarter of a core, so a first copy into a range does not fault page by page (8 bytes of page table per 4 KiB: 4096 MiB cost 8 MiB; 0 turns it off: each 2 MiB chunk is then filled on first touch)" },
    EnvVar { name: "KVFERRY_STORE_CLIENT_MIN_PORT", aliases: &["MC_STORE_CLIENT_MIN_PORT"], default: "12300", doc: "store client with central metadata and a local_hostname without a port: lowest port bound and appended to the hostname (`host:port` is then its segment name)" },
    EnvVar { name: "KVFERRY_STORE_CLIENT_MAX_PORT", aliases: &["MC_STORE_CLIENT_MAX_PORT"], default: "14300", doc: "highest such port" },
    EnvVar { name: "KVFERRY_STORE_CLIENT_SETUP_RETRIES", aliases: &["MC_STORE_CLIENT_SETUP_RETRIES"], default: "20", doc: "ports tried when the segment name `host:port` is already taken by a live engine (1-1000)" },
    EnvVar { name: "KVFERRY_STORE_CLUSTER_ID", aliases: &["MC_STORE_CLUSTER_ID"], default: "mooncake_cluster", doc: "store high availability: the cluster whose leader key `mooncake-store/<id>/master_view` a client with `master_server_addr = \"etcd://...\"` reads, and a master started with `--enable-ha` and no `--cluster-id` campaigns for" },
    EnvVar { name: "KVFERRY_AUTH_KEY_FILE", aliases: &[], default: "(none: no authentication, as Mooncake)", doc: "a file holding the cluster's key, readable by its owner only (`chmod 600`; one per line, at least 32 bytes each, e.g. `openssl rand -hex 32`; a second line is the key being replaced, still accepted): engines on their handshake and TCP data ports, store clients and the master, and HA masters on their replication links run a Noise handshake keyed by it (Noise_NNpsk0, the key never sent) bound to the endpoint dialed, and seal every frame after it; the master's state routes and every metadata-server write need a request signed with it. A side without it is refused, saying so. Stock Mooncake peers cannot; leave it unset where they must interoperate (docs/ARCHITECTURE.md, \"Authenticated peers\")" },
    EnvVar { name: "KVFERRY_AUTH_PROTECT", aliases: &[], default: "headers", doc: "with a cluster key, what a TCP data connection protects beyond the handshake: `headers` (every request header and status frame sealed: nothing injected, replayed or redirected; the bytes moved travel as they are), `payload` (those bytes also authenticated: a BLAKE3 digest of each 32 KiB sealed after it), `encrypt` (those bytes sealed too: nothing on the path reads them). An engine refuses connections asking for less than its own setting. Costs: docs/BENCHMARKS.md" },
    EnvVar { name: "KVFERRY_LOG", aliases: &["MC_LOG_LEVEL"], default: "warn", doc: "log filter for the `kvferry` binary (`error`, `warn`, `info`, `debug`, `trace`, or tracing directives)" },
    // Read by the `kvferry` command only.
    EnvVar { name: "MOONCAKE_TE_META_DATA_SERVER", aliases: &[], default: "(none)", doc: "`kvferry master --enable-metadata-cleanup-on-timeout`: Mooncake's name for the metadata service whose entries of dropped clients are removed, read after KVFERRY_METADATA_SERVER (an engine reads only KVFERRY_METADATA_SERVER)" },
    EnvVar { name: "MOONCAKE_CONFIG_PATH", aliases: &[], default: "(none)", doc: "`kvferry master --enable-metadata-cleanup-on-timeout`: Mooncake's JSON client configuration, whose `metadata_server` names the service to clean when neither metadata variable is set" },
    EnvVar { name: "MOONCAKE_MASTER", aliases: &[], default: "(none)", doc: "Python `mooncake_config.MooncakeConfig.load_from_env()` (Mooncake's): the master address when `MOONCAKE_CONFIG_PATH` is not set; with it, as Mooncake, `MOONCAKE_LOCAL_HOSTNAME`, `MOONCAKE_TE_META_DATA_SERVER`, `MOONCAKE_GLOBAL_SEGMENT_SIZE`, `MOONCAKE_LOCAL_BUFFER_SIZE`, `MOONCAKE_PROTOCOL`, `MOONCAKE_DEVICE`, `MOONCAKE_OFFLOAD_ENABLED`, `MOONCAKE_TENANT_ID`, `MOONCAKE_ENABLE_CLIENT_HTTP_SERVER`, `MOONCAKE_CLIENT_HTTP_PORT`" },
    EnvVar { name: "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", aliases: &[], default: "(none)", doc: "store clients with `enable_ssd_offload` and no `ssd_offload_path` (Mooncake's): the disk tier's directory" },
    EnvVar { name: "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", aliases: &[], default: "1 TiB", doc: "the disk tier's capacity in bytes (its least recently used records are evicted past it)" },
    EnvVar { name: "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", aliases: &[], default: "64 MiB", doc: "the disk tier's registered staging buffer, through which readers get objects from disk (a larger value is refused, naming this)" },
    EnvVar { name: "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", aliases: &[], default: "1", doc: "how often the disk tier reports to the master and takes its orders" },
    EnvVar { name: "MC_METADATA_HTTP_ALLOW_INSECURE", aliases: &[], default: "(unset)", doc: "Python `mooncake.http_metadata_server` (0.3.14's rule): `1` lets it serve a non-loopback address without `MC_METADATA_HTTP_TOKEN`" },
    EnvVar { name: "MC_METADATA_MAX_BODY_BYTES", aliases: &[], default: "1 MiB", doc: "Python `mooncake.http_metadata_server`: the largest request body (413 beyond), as 0.3.14" },
    EnvVar { name: "MC_METADATA_MAX_KEYS", aliases: &[], default: "65536", doc: "Python `mooncake.http_metadata_server`: the most keys it holds (507 beyond), as 0.3.14; `kvferry metadata-server --max-keys` for kvferry's" },
    EnvVar { name: "MC_METADATA_MAX_TOTAL_BYTES", aliases: &[], default: "1 GiB", doc: "Python `mooncake.http_metadata_server`: the most bytes of keys and values it holds (507 beyond), as 0.3.14; `kvferry metadata-server --max-total-bytes` for kvferry's" },
    EnvVar { name: "KVFERRY_MOONCAKE_BENCH", aliases: &[], default: "transfer_engine_bench on PATH", doc: "`kvferry bench`: Mooncake's `transfer_engine_bench`, run side by side when the command line names none (`none`: not run)" },
    EnvVar { name: "KVFERRY_MOONCAKE_PYTHON", aliases: &[], default: "(none)", doc: "`kvferry store-bench` and `kvferry metadata-bench`: a Python with stock Mooncake installed (its `mooncake_http_metadata_server` beside it), for the side-by-side runs when the command line names none (`none`: not run); the interop tests use it too" },
    // Read by the Python package only.
    EnvVar { name: "KVFERRY_MOONCAKE_SHIM", aliases: &[], default: "0", doc: "Python: set (to anything but `0`, `false`, `no` or `off`), `import mooncake.engine` / `mooncake.store` give kvferry's drop-in modules (the wheel's `.pth` file)" },
    EnvVar { name: "KVFERRY_BIN", aliases: &[], default: "the wheel's own `kvferry` command", doc: "Python: the `kvferry` binary `kvferry.mooncake.http_metadata_server` runs (a build from source)" },
    EnvVar { name: "MC_HANDSHAKE_PORT", aliases: &[], default: "12001", doc: "Python (`kvferry.mooncake.engine`): the handshake port added to a peer name given without one, as Mooncake's probe does" },
];

/// The engine's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `host` or `host:port`; the host part is advertised to peers and must be reachable by them.
    pub local_hostname: String,
    /// `P2PHANDSHAKE` (peers exchange descriptors directly) or a metadata service:
    /// `http(s)://host:port/metadata`, `etcd://h1:2379,h2:2379` (or bare `host:port`),
    /// `redis://[user:pass@]host:port[/db]` (see [`crate::metadata`]).
    pub metadata_server: String,
    /// Key namespace in the metadata service (`mooncake/<id>/...`).
    pub metadata_cluster_id: Option<String>,
    /// Bound of one metadata request.
    pub metadata_timeout: Duration,
    /// TTL of the etcd lease an engine's entries live under.
    pub metadata_lease_ttl: Duration,
    /// `https://` metadata server: PEM file of the CA certificates to trust.
    pub metadata_ca_file: Option<std::path::PathBuf>,
    /// The shared token of HTTP metadata servers (`KVFERRY_METADATA_HTTP_TOKEN`,
    /// `MC_METADATA_HTTP_TOKEN`): sent as `Authorization: Bearer <token>`, and required by
    /// kvferry's servers when they have one. `None` (unset or blank): no token.
    pub metadata_http_token: Option<String>,
    /// The cluster key file (`KVFERRY_AUTH_KEY_FILE`, [`crate::auth`]); `None`: no
    /// authentication.
    pub auth_key_file: Option<std::path::PathBuf>,
    /// What a keyed TCP data connection protects (`KVFERRY_AUTH_PROTECT`).
    pub auth_protect: crate::auth::Protect,
    /// Central mode: the address published in `rpc_meta` and bound, when `local_hostname`
    /// is a logical name.
    pub advertise_address: Option<String>,
    pub redis_username: Option<String>,
    pub redis_password: Option<String>,
    pub redis_db: Option<u32>,
    pub min_port: u16,
    pub max_port: u16,
    /// Address the listeners bind; `None` binds the advertised address.
    pub bind_address: Option<IpAddr>,
    pub transfer_timeout: Duration,
    pub tcp_lanes: usize,
    pub tcp_split_bytes: u64,
    /// How long a lone small synchronous request polls for its answer before sleeping.
    pub spin: Duration,
    /// An unused TCP lane is closed after this long (KVFERRY_TCP_IDLE_MS).
    pub tcp_idle: Duration,
    /// Store clients: ports appended to a bare local_hostname in central mode, and how many
    /// are tried when the name is taken.
    pub store_client_ports: (u16, u16),
    pub store_client_setup_retries: u32,
    /// Store HA: the cluster id (`KVFERRY_STORE_CLUSTER_ID` / `MC_STORE_CLUSTER_ID`); `None`
    /// means Mooncake's `mooncake_cluster`.
    pub store_cluster_id: Option<String>,
    /// Highest TCP data protocol version to speak (1 or 2).
    pub tcp_proto: u32,
    pub handshake_max_len: u64,
    pub handshake_connect_timeout: Duration,
    /// Data path to peers (`KVFERRY_TRANSPORT`).
    pub transport: TransportMode,
    /// Shared-memory copy threads; 0 means the number of CPUs, at most 4.
    pub shm_threads: usize,
    /// Bytes of same-host peers' fully allocated buffers whose page tables are filled in
    /// the background, per engine (`KVFERRY_SHM_BACKGROUND_FILL_MB`; 0: none).
    pub shm_background_fill: u64,
    /// RDMA devices to use (`KVFERRY_RDMA_DEVICES`); `None`: every device with an active port.
    pub rdma_devices: Option<Vec<String>>,
    /// RDMA GID index (`MC_GID_INDEX`); `None`: chosen per NIC.
    pub gid_index: Option<u32>,
    /// Connected RDMA endpoints kept (`KVFERRY_RDMA_MAX_ENDPOINTS`); the least recently used
    /// idle one beyond it is closed.
    pub rdma_max_endpoints: usize,
    /// QPs made for peers that connect to this engine, all together
    /// (`KVFERRY_RDMA_MAX_PASSIVE_QPS`); a connection beyond it is refused.
    pub rdma_max_passive_qps: usize,
    /// QP transport retries (`KVFERRY_RDMA_RETRY_CNT`, 0-7).
    pub rdma_retry_cnt: u8,
    /// Whether `auto` uses RDMA where a port is usable (`KVFERRY_AUTO_RDMA`; Mooncake's
    /// `MC_FORCE_TCP=1` turns it off).
    pub auto_rdma: bool,
    /// `auto` must open RDMA or fail to start (`KVFERRY_AUTO_RDMA=force`, Mooncake's
    /// `MC_FORCE_HCA=1`).
    pub rdma_forced: bool,
    /// The NIC priority matrix file (`KVFERRY_RDMA_TOPO`, Mooncake's `MC_CUSTOM_TOPO_JSON`);
    /// `None`: discovered.
    pub rdma_topo: Option<std::path::PathBuf>,
    /// How GPU memory is registered with RDMA NICs (`KVFERRY_GPU_RDMA`; Mooncake's
    /// `WITH_NVIDIA_PEERMEM`).
    pub gpu_rdma: crate::gpu::direct::GpuRdma,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            local_hostname: "127.0.0.1".into(),
            metadata_server: "P2PHANDSHAKE".into(),
            metadata_cluster_id: None,
            metadata_timeout: Duration::from_secs(3),
            metadata_lease_ttl: Duration::from_secs(10),
            metadata_ca_file: None,
            metadata_http_token: None,
            auth_key_file: None,
            auth_protect: crate::auth::Protect::Headers,
            advertise_address: None,
            redis_username: None,
            redis_password: None,
            redis_db: None,
            min_port: 15000,
            max_port: 17000,
            bind_address: None,
            transfer_timeout: Duration::from_secs(30),
            tcp_lanes: 2,
            tcp_split_bytes: 4 << 20,
            spin: Duration::from_micros(50),
            tcp_idle: Duration::from_secs(5),
            store_client_ports: (12300, 14300),
            store_client_setup_retries: 20,
            store_cluster_id: None,
            tcp_proto: 2,
            handshake_max_len: crate::wire::handshake::DEFAULT_MAX_FRAME,
            handshake_connect_timeout: Duration::from_secs(5),
            transport: TransportMode::Auto,
            shm_threads: 0,
            shm_background_fill: 4096 << 20,
            rdma_devices: None,
            gid_index: None,
            rdma_max_endpoints: 256,
            rdma_max_passive_qps: 16384,
            rdma_retry_cnt: 7,
            auto_rdma: true,
            rdma_forced: false,
            rdma_topo: None,
            gpu_rdma: crate::gpu::direct::GpuRdma::Auto,
        }
    }
}

fn lookup(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<(String, String)> {
    let v = ENV_VARS
        .iter()
        .find(|v| v.name == var)
        .expect("known variable");
    std::iter::once(v.name)
        .chain(v.aliases.iter().copied())
        .find_map(|n| {
            get(n)
                .filter(|s| !s.trim().is_empty())
                .map(|s| (n.to_string(), s.trim().to_string()))
        })
}

fn parse<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    var: &str,
    what: &str,
) -> Result<Option<T>> {
    match lookup(get, var) {
        None => Ok(None),
        Some((name, s)) => s
            .parse::<T>()
            .map(Some)
            .map_err(|_| Error::Config(format!("{name}={s:?} is not {what}"))),
    }
}

fn seconds(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<Duration>> {
    match parse::<f64>(get, var, "a number of seconds")? {
        Some(s) if s > 0.0 && s.is_finite() && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(Error::Config(format!(
            "{var}={s} must be a positive number of seconds"
        ))),
        None => Ok(None),
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (tests pass a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        if let Some(p) = parse(get, "KVFERRY_MIN_PORT", "a port number")? {
            c.min_port = p;
        }
        if let Some(p) = parse(get, "KVFERRY_MAX_PORT", "a port number")? {
            c.max_port = p;
        }
        if let Some(p) = parse(get, "KVFERRY_STORE_CLIENT_MIN_PORT", "a port number")? {
            c.store_client_ports.0 = p;
        }
        if let Some(p) = parse(get, "KVFERRY_STORE_CLIENT_MAX_PORT", "a port number")? {
            c.store_client_ports.1 = p;
        }
        if let Some(n) = parse(
            get,
            "KVFERRY_STORE_CLIENT_SETUP_RETRIES",
            "a number of attempts",
        )? {
            c.store_client_setup_retries = n;
        }
        if let Some(a) = parse(get, "KVFERRY_BIND_ADDRESS", "an IP address")? {
            c.bind_address = Some(a);
        }
        if let Some(d) = seconds(get, "KVFERRY_TRANSFER_TIMEOUT")? {
            c.transfer_timeout = d;
        }
        if let Some(n) = parse(get, "KVFERRY_TCP_LANES", "a number of lanes")? {
            c.tcp_lanes = n;
        }
        if let Some(n) = parse(get, "KVFERRY_TCP_SPLIT_BYTES", "a byte count")? {
            c.tcp_split_bytes = n;
        }
        if let Some(n) = parse::<u64>(get, "KVFERRY_SPIN_US", "a number of microseconds")? {
            if n > 1_000_000 {
                return Err(Error::Config(format!("KVFERRY_SPIN_US={n} is more than a second; use at most 1000000 (0 disables polling)")));
            }
            c.spin = Duration::from_micros(n);
        }
        if let Some(n) = parse::<u64>(get, "KVFERRY_TCP_IDLE_MS", "a number of milliseconds")? {
            if !(10..=3_600_000).contains(&n) {
                return Err(Error::Config(format!(
                    "KVFERRY_TCP_IDLE_MS={n} is out of range; use 10 to 3600000 milliseconds"
                )));
            }
            c.tcp_idle = Duration::from_millis(n);
        }
        if let Some(n) = parse(get, "KVFERRY_TCP_PROTO", "1 or 2")? {
            c.tcp_proto = n;
        }
        if let Some(n) = parse(get, "KVFERRY_HANDSHAKE_MAX_LENGTH", "a byte count")? {
            c.handshake_max_len = n;
        }
        if let Some(d) = seconds(get, "KVFERRY_HANDSHAKE_CONNECT_TIMEOUT")? {
            c.handshake_connect_timeout = d;
        }
        if let Some((_, v)) = lookup(get, "KVFERRY_RDMA_DEVICES") {
            c.rdma_devices = Some(
                v.split(',')
                    .map(|d| d.trim().to_string())
                    .filter(|d| !d.is_empty())
                    .collect(),
            );
        }
        if let Some(n) = parse::<usize>(get, "KVFERRY_RDMA_MAX_ENDPOINTS", "a number of endpoints")?
        {
            if !(1..=65536).contains(&n) {
                return Err(Error::Config(format!(
                    "KVFERRY_RDMA_MAX_ENDPOINTS={n} is out of range; use 1 to 65536 endpoints"
                )));
            }
            c.rdma_max_endpoints = n;
        }
        if let Some(n) = parse::<usize>(get, "KVFERRY_RDMA_MAX_PASSIVE_QPS", "a number of QPs")? {
            if !(1..=1 << 20).contains(&n) {
                return Err(Error::Config(format!(
                    "KVFERRY_RDMA_MAX_PASSIVE_QPS={n} is out of range; use 1 to 1048576 QPs"
                )));
            }
            c.rdma_max_passive_qps = n;
        }
        if let Some(n) = parse::<u8>(get, "KVFERRY_RDMA_RETRY_CNT", "a retry count (0-7)")? {
            if n > 7 {
                return Err(Error::Config(format!(
                    "KVFERRY_RDMA_RETRY_CNT={n} is out of range; use 0 to 7"
                )));
            }
            c.rdma_retry_cnt = n;
        }
        let truth = |name: &str, v: &str| match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(Error::Config(format!(
                "{name}={v:?} is not a boolean; use 1 or 0"
            ))),
        };
        let mc_force_tcp = match get("MC_FORCE_TCP").filter(|v| !v.trim().is_empty()) {
            Some(v) => truth("MC_FORCE_TCP", v.trim())?,
            None => false,
        };
        if let Some((name, v)) = lookup(get, "KVFERRY_AUTO_RDMA") {
            if v.eq_ignore_ascii_case("force") {
                c.rdma_forced = true;
            } else {
                c.auto_rdma = truth(&name, &v)
                    .map_err(|_| Error::Config(format!("{name}={v:?} is not 1, 0 or force")))?;
            }
        } else if mc_force_tcp {
            c.auto_rdma = false;
        } else if let Some(v) = get("MC_FORCE_HCA").filter(|v| !v.trim().is_empty()) {
            c.rdma_forced = truth("MC_FORCE_HCA", v.trim())?;
        }
        if let Some((_, v)) = lookup(get, "KVFERRY_RDMA_TOPO") {
            c.rdma_topo = Some(v.into());
        }
        if let Some((name, v)) = lookup(get, "KVFERRY_GPU_RDMA") {
            c.gpu_rdma = crate::gpu::direct::GpuRdma::parse(&v).ok_or_else(|| {
                Error::Config(format!("{name}={v:?} is not auto, dmabuf or peermem"))
            })?;
        } else if let Some(v) = get("WITH_NVIDIA_PEERMEM").filter(|v| !v.trim().is_empty()) {
            c.gpu_rdma = crate::gpu::direct::GpuRdma::from_with_nvidia_peermem(&v);
        }
        if let Some(n) = parse(get, "KVFERRY_GID_INDEX", "a GID index (0-255)")? {
            c.gid_index = Some(n);
        }
        if let Some(t) = parse(get, "KVFERRY_TRANSPORT", "auto, tcp, shm or rdma")? {
            c.transport = t;
        }
        if let Some(n) = parse(get, "KVFERRY_SHM_THREADS", "a number of threads")? {
            c.shm_threads = n;
        }
        if let Some(n) = parse::<u64>(
            get,
            "KVFERRY_SHM_BACKGROUND_FILL_MB",
            "a number of MiB (0: off)",
        )? {
            c.shm_background_fill = n.checked_mul(1 << 20).ok_or_else(|| Error::Config(format!("KVFERRY_SHM_BACKGROUND_FILL_MB={n} is too large: give at most {} MiB (0 turns the fill off)", u64::MAX >> 20)))?;
        }
        if let Some((_, v)) = lookup(get, "KVFERRY_METADATA_SERVER") {
            c.metadata_server = v;
        }
        c.metadata_cluster_id = lookup(get, "KVFERRY_METADATA_CLUSTER_ID").map(|(_, v)| v);
        c.store_cluster_id = lookup(get, "KVFERRY_STORE_CLUSTER_ID").map(|(_, v)| v);
        if let Some(d) = seconds(get, "KVFERRY_METADATA_TIMEOUT")? {
            c.metadata_timeout = d;
        }
        if let Some(d) = seconds(get, "KVFERRY_METADATA_LEASE_TTL")? {
            c.metadata_lease_ttl = d;
        }
        c.metadata_ca_file = lookup(get, "KVFERRY_METADATA_CA_FILE").map(|(_, v)| v.into());
        if let Some((name, v)) = lookup(get, "KVFERRY_METADATA_HTTP_TOKEN") {
            // It travels in an HTTP header: printable ASCII only (no control characters).
            if !v.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                return Err(Error::Config(format!(
                    "{name} holds a character an HTTP header cannot carry: use printable ASCII \
                    (e.g. `openssl rand -hex 32`), the same on the metadata server and every engine"
                )));
            }
            c.metadata_http_token = Some(v);
        }
        c.auth_key_file = lookup(get, "KVFERRY_AUTH_KEY_FILE").map(|(_, v)| v.into());
        if let Some((name, v)) = lookup(get, "KVFERRY_AUTH_PROTECT") {
            c.auth_protect = crate::auth::Protect::parse(&v).ok_or_else(|| {
                Error::Config(format!("{name}={v:?} is not headers, payload or encrypt"))
            })?;
        }
        c.advertise_address = lookup(get, "KVFERRY_ADVERTISE_ADDRESS").map(|(_, v)| v);
        c.redis_username = lookup(get, "KVFERRY_REDIS_USERNAME").map(|(_, v)| v);
        c.redis_password = lookup(get, "KVFERRY_REDIS_PASSWORD").map(|(_, v)| v);
        if let Some(n) = parse::<u32>(get, "KVFERRY_REDIS_DB_INDEX", "a database number")? {
            c.redis_db = Some(n);
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks ranges and relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.min_port < 1024 || self.min_port > self.max_port {
            return Err(Error::Config(format!(
                "port range {}-{} is invalid: need 1024 <= KVFERRY_MIN_PORT <= KVFERRY_MAX_PORT",
                self.min_port, self.max_port
            )));
        }
        let (lo, hi) = self.store_client_ports;
        if lo == 0 || lo > hi {
            return Err(Error::Config(format!(
                "store client port range {lo}-{hi} is invalid: need 1 <= KVFERRY_STORE_CLIENT_MIN_PORT <= KVFERRY_STORE_CLIENT_MAX_PORT"
            )));
        }
        if !(1..=1000).contains(&self.store_client_setup_retries) {
            return Err(Error::Config(format!(
                "KVFERRY_STORE_CLIENT_SETUP_RETRIES={} must be between 1 and 1000",
                self.store_client_setup_retries
            )));
        }
        if !(1..=16).contains(&self.tcp_lanes) {
            return Err(Error::Config(format!(
                "KVFERRY_TCP_LANES={} must be between 1 and 16",
                self.tcp_lanes
            )));
        }
        if self.tcp_split_bytes < 4096 {
            return Err(Error::Config(format!(
                "KVFERRY_TCP_SPLIT_BYTES={} must be at least 4096",
                self.tcp_split_bytes
            )));
        }
        if self.shm_threads > 64 {
            return Err(Error::Config(format!(
                "KVFERRY_SHM_THREADS={} must be between 1 and 64",
                self.shm_threads
            )));
        }
        if !(1..=2).contains(&self.tcp_proto) {
            return Err(Error::Config(format!(
                "KVFERRY_TCP_PROTO={} must be 1 or 2",
                self.tcp_proto
            )));
        }
        if !(1..=crate::wire::handshake::MAX_MAX_FRAME).contains(&self.handshake_max_len) {
            return Err(Error::Config(format!(
                "KVFERRY_HANDSHAKE_MAX_LENGTH={} must be between 1 and 134217728",
                self.handshake_max_len
            )));
        }
        crate::metadata::ConnString::parse(&self.metadata_server)?;
        if self.metadata_lease_ttl < Duration::from_secs(2) {
            return Err(Error::Config(format!(
                "KVFERRY_METADATA_LEASE_TTL={:?} must be at least 2 seconds",
                self.metadata_lease_ttl
            )));
        }
        if self.redis_db.is_some_and(|d| d > 255) {
            return Err(Error::Config(format!(
                "KVFERRY_REDIS_DB_INDEX={:?} must be between 0 and 255",
                self.redis_db
            )));
        }
        Ok(())
    }

    /// Whether a metadata service (not P2PHANDSHAKE) is configured.
    pub fn central(&self) -> bool {
        self.metadata_server.trim() != "P2PHANDSHAKE"
    }

    /// The host part of `local_hostname` (brackets of an IPv6 literal removed); in central
    /// metadata mode `advertise_address` when set.
    pub fn advertised_host(&self) -> &str {
        match &self.advertise_address {
            Some(a) if self.central() && !a.is_empty() => {
                a.trim_start_matches('[').trim_end_matches(']')
            }
            _ => split_host_port(&self.local_hostname).0,
        }
    }
}

/// What Mooncake's `initialize(local_hostname, metadata_server, protocol, device_name)` (and
/// its store's `setup(..., protocol, rdma_devices, ...)`) asked of the engine, as
/// [`Config::apply_initialize_args`] applied it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InitializeArgs {
    /// `protocol="rdma"` made the engine RDMA-only ([`TransportMode::Rdma`]).
    pub rdma_required: bool,
    /// The NICs `device_name` named (trimmed), when it named any.
    pub device_names: Option<Vec<String>>,
    /// The environment variable that filters the NICs too (`KVFERRY_RDMA_DEVICES` or
    /// `MC_TE_FILTERS`), with its value, when set.
    pub env_filter: Option<(String, String)>,
}

/// Splits Mooncake's `device_name` (`"mlx5_0,mlx5_1"`) into NIC names; `None` for every NIC
/// (empty, or the store's `"auto-discovery"`). A NIC priority matrix (JSON) is refused:
/// Mooncake's `initialize` takes names there too (and would match none).
pub(crate) fn parse_device_names(device_name: &str) -> Result<Option<Vec<String>>> {
    let d = device_name.trim();
    if d.starts_with('{') || d.starts_with('[') || d.ends_with(".json") {
        return Err(Error::Config(format!(
            "device_name {d:?} is not a list of NIC names: initialize() takes them comma-separated (e.g. \"mlx5_0,mlx5_1\"), as Mooncake's does; give a NIC priority matrix file with KVFERRY_RDMA_TOPO (Mooncake's MC_CUSTOM_TOPO_JSON)"
        )));
    }
    let names: Vec<String> = d
        .split(',')
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .collect();
    Ok((!names.is_empty() && d != "auto-discovery").then_some(names))
}

impl Config {
    /// Applies Mooncake's `initialize(..., protocol, device_name)` to a configuration read
    /// from the environment that `get` reads (as for [`Config::from_lookup`]):
    ///
    /// - `protocol="rdma"`: RDMA only ([`TransportMode::Rdma`]): the engine publishes an RDMA
    ///   segment descriptor, as a Mooncake RDMA engine does (so Mooncake's RDMA initiators
    ///   reach it), and does not start without a usable NIC ([`InitializeArgs::check_rdma`]
    ///   says why, and what to do).
    /// - `"tcp"`, `""` and anything else: the transport is left as configured (by default
    ///   `auto`: a TCP descriptor, which every Mooncake engine reaches; shared memory to kvferry
    ///   peers on this host; RDMA as the initiator towards peers that publish it).
    /// - An explicit `KVFERRY_TRANSPORT` wins over `protocol`, and so does Mooncake's
    ///   `MC_FORCE_TCP=1` (TCP whatever else is asked, as in Mooncake); each is logged.
    /// - `device_name`: the NICs to use (comma-separated NIC names); with `KVFERRY_RDMA_DEVICES`
    ///   (`MC_TE_FILTERS`) set too, only the NICs both name, as Mooncake applies
    ///   `MC_TE_FILTERS` to `device_name`'s list.
    pub fn apply_initialize_args(
        &mut self,
        protocol: &str,
        device_name: &str,
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Result<InitializeArgs> {
        let mut args = InitializeArgs {
            env_filter: lookup(get, "KVFERRY_RDMA_DEVICES"),
            ..InitializeArgs::default()
        };
        if let Some(names) = parse_device_names(device_name)? {
            let allowed = match &self.rdma_devices {
                Some(env) if args.env_filter.is_some() => {
                    names.iter().filter(|n| env.contains(n)).cloned().collect()
                }
                _ => names.clone(),
            };
            if allowed.len() < names.len() {
                let (var, v) = args.env_filter.as_ref().expect("set");
                tracing::warn!("device_name {device_name:?}: {var}={v:?} leaves out NICs it names; only {allowed:?} are used");
            }
            self.rdma_devices = Some(allowed);
            args.device_names = Some(names);
        }
        let protocol = protocol.trim().to_ascii_lowercase();
        if protocol != "rdma" {
            return Ok(args);
        }
        if let Some((var, v)) = lookup(get, "KVFERRY_TRANSPORT") {
            if self.transport != TransportMode::Rdma {
                tracing::info!("protocol \"rdma\" asked for RDMA only; {var}={v} wins");
            }
        } else if get("MC_FORCE_TCP").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        }) {
            tracing::info!(
                "protocol \"rdma\" asked for RDMA only; MC_FORCE_TCP wins (TCP, as in Mooncake)"
            );
        } else {
            self.transport = TransportMode::Rdma;
            args.rdma_required = true;
        }
        Ok(args)
    }
}

impl InitializeArgs {
    /// Where `protocol="rdma"` made the engine RDMA-only: whether this host can do it with
    /// the NICs allowed (`devices`, as applied), per `probe`; if not, the error says why and
    /// what to do. (The engine checks the rest when it opens the NICs.)
    pub fn check_rdma(&self, probe: &crate::nic::Probe, devices: Option<&[String]>) -> Result<()> {
        if !self.rdma_required {
            return Ok(());
        }
        let asked = match &self.device_names {
            Some(d) => format!("protocol=\"rdma\", device_name={:?}", d.join(",")),
            None => "protocol=\"rdma\"".to_string(),
        };
        let fix = "Fix: run it where an RDMA NIC has an ACTIVE port (`kvferry doctor` shows what this host has), or pass protocol=\"tcp\" (or set MC_FORCE_TCP=1) to move data over TCP";
        let why = match (probe.why_not(), devices) {
            (Some(why), _) => why,
            (None, Some(only)) => {
                let active = |n: &crate::nic::sysfs::Nic| n.ports.iter().any(|p| p.active);
                if probe
                    .nics
                    .iter()
                    .any(|n| active(n) && only.contains(&n.name))
                {
                    return Ok(());
                }
                let found: Vec<String> = probe
                    .nics
                    .iter()
                    .map(|n| {
                        format!(
                            "{}{}",
                            n.name,
                            if active(n) { "" } else { " (no ACTIVE port)" }
                        )
                    })
                    .collect();
                let named = match (&self.device_names, &self.env_filter) {
                    (Some(_), Some((var, v))) => format!(
                        "device_name with {var}={v:?} allows {only:?}, and none of them has an ACTIVE port"
                    ),
                    (None, Some((var, v))) => {
                        format!("none of the NICs {var}={v:?} names has an ACTIVE port")
                    }
                    _ => format!("none of the NICs {only:?} has an ACTIVE port"),
                };
                format!(
                    "{named} (this host has: {}); name NICs of this host in device_name, comma-separated",
                    if found.is_empty() { "none".to_string() } else { found.join(", ") }
                )
            }
            (None, None) => return Ok(()),
        };
        Err(Error::Config(format!(
            "{asked} asks for RDMA only (the engine publishes an RDMA segment descriptor, as Mooncake's RDMA engine does), and this host cannot do it: {why}. {fix}"
        )))
    }
}

/// Splits `host[:port]`, `[v6]:port` or a bare IPv6 literal.
pub fn split_host_port(s: &str) -> (&str, Option<u16>) {
    let s = s.trim_start_matches('/');
    if let Some(rest) = s.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            return (host, tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (s, None),
        },
        _ => (s, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |k| m.get(k).cloned())
    }

    #[test]
    fn defaults_aliases_and_precedence() {
        assert_eq!(cfg(&[]).unwrap(), Config::default());
        let c = cfg(&[
            ("MC_MIN_RPC_PORT", "20000"),
            ("MC_MAX_RPC_PORT", "20010"),
            ("MC_TRANSFER_TIMEOUT", "7"),
            ("MC_TCP_PROTO", "1"),
        ])
        .unwrap();
        assert_eq!((c.min_port, c.max_port, c.tcp_proto), (20000, 20010, 1));
        assert_eq!(c.transfer_timeout, Duration::from_secs(7));
        let c = cfg(&[("MC_TCP_LANES_PER_PEER", "3"), ("KVFERRY_TCP_LANES", "5")]).unwrap();
        assert_eq!(c.tcp_lanes, 5, "KVFERRY_* wins over MC_*");
    }

    #[test]
    fn errors_name_the_variable() {
        let e = cfg(&[("MC_MIN_RPC_PORT", "abc")]).unwrap_err().to_string();
        assert!(e.contains("MC_MIN_RPC_PORT"), "{e}");
        let e = cfg(&[("KVFERRY_MIN_PORT", "18000")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("port range"), "{e}");
        assert!(cfg(&[("KVFERRY_TCP_LANES", "0")]).is_err());
        assert!(cfg(&[("KVFERRY_TRANSFER_TIMEOUT", "-1")]).is_err());
        assert!(cfg(&[("KVFERRY_BIND_ADDRESS", "nowhere")]).is_err());
        let e = cfg(&[("KVFERRY_METADATA_SERVER", "zk://h:1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown scheme") && e.contains("etcd://"), "{e}");
        assert!(cfg(&[("KVFERRY_METADATA_LEASE_TTL", "1")]).is_err());
    }

    #[test]
    fn metadata_settings() {
        let c = cfg(&[
            ("KVFERRY_METADATA_SERVER", "etcd://127.0.0.1:2379"),
            ("MC_METADATA_CLUSTER_ID", "c1"),
            ("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
            ("MC_REDIS_DB_INDEX", "3"),
        ])
        .unwrap();
        assert!(c.central());
        assert_eq!(c.metadata_cluster_id.as_deref(), Some("c1"));
        let s =
            Config::from_lookup(&|k| (k == "MC_STORE_CLUSTER_ID").then(|| "store-c".to_string()))
                .unwrap();
        assert_eq!(
            (s.store_cluster_id.as_deref(), c.store_cluster_id.as_deref()),
            (Some("store-c"), None)
        );
        assert_eq!(c.redis_db, Some(3));
        let c = Config {
            local_hostname: "prefill-0".into(),
            ..c
        };
        assert_eq!(c.advertised_host(), "127.0.0.1");
        let p2p = Config {
            advertise_address: Some("10.0.0.1".into()),
            ..Config::default()
        };
        assert_eq!(
            p2p.advertised_host(),
            "127.0.0.1",
            "P2P mode names segments by local_hostname"
        );
    }

    #[test]
    fn background_fill_budget() {
        assert_eq!(cfg(&[]).unwrap().shm_background_fill, 4096 << 20);
        assert_eq!(
            cfg(&[("KVFERRY_SHM_BACKGROUND_FILL_MB", "16")])
                .unwrap()
                .shm_background_fill,
            16 << 20
        );
        assert_eq!(
            cfg(&[("KVFERRY_SHM_BACKGROUND_FILL_MB", "0")])
                .unwrap()
                .shm_background_fill,
            0,
            "0 turns it off"
        );
        let e = cfg(&[("KVFERRY_SHM_BACKGROUND_FILL_MB", "lots")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KVFERRY_SHM_BACKGROUND_FILL_MB") && e.contains("MiB"),
            "{e}"
        );
        let e = cfg(&[("KVFERRY_SHM_BACKGROUND_FILL_MB", &u64::MAX.to_string())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("too large") && e.contains("at most"), "{e}");
    }

    #[test]
    fn transport_choice() {
        assert_eq!(cfg(&[]).unwrap().transport, TransportMode::Auto);
        assert_eq!(
            cfg(&[("KVFERRY_TRANSPORT", "TCP")]).unwrap().transport,
            TransportMode::Tcp
        );
        assert_eq!(
            cfg(&[("KVFERRY_TRANSPORT", "shm"), ("KVFERRY_SHM_THREADS", "3")])
                .unwrap()
                .shm_threads,
            3
        );
        assert_eq!(
            cfg(&[("KVFERRY_TRANSPORT", "rdma")]).unwrap().transport,
            TransportMode::Rdma
        );
        assert!(
            cfg(&[]).unwrap().auto_rdma,
            "auto uses RDMA where it can by default"
        );
        assert!(
            !cfg(&[("MC_FORCE_TCP", "1")]).unwrap().auto_rdma,
            "Mooncake's MC_FORCE_TCP=1 keeps auto off RDMA"
        );
        assert!(cfg(&[("MC_FORCE_TCP", "false")]).unwrap().auto_rdma);
        assert!(
            cfg(&[("MC_FORCE_HCA", "1")]).unwrap().rdma_forced,
            "Mooncake's MC_FORCE_HCA: RDMA or an error"
        );
        assert!(
            !cfg(&[("MC_FORCE_HCA", "1"), ("MC_FORCE_TCP", "1")])
                .unwrap()
                .rdma_forced,
            "MC_FORCE_TCP wins, as in Mooncake"
        );
        assert!(cfg(&[("KVFERRY_AUTO_RDMA", "force")]).unwrap().rdma_forced);
        assert!(cfg(&[("KVFERRY_AUTO_RDMA", "maybe")])
            .unwrap_err()
            .to_string()
            .contains("1, 0 or force"));
        assert_eq!(
            cfg(&[("MC_CUSTOM_TOPO_JSON", "/etc/topo.json")])
                .unwrap()
                .rdma_topo,
            Some("/etc/topo.json".into())
        );
        assert!(
            cfg(&[("MC_FORCE_TCP", "1"), ("KVFERRY_AUTO_RDMA", "1")])
                .unwrap()
                .auto_rdma,
            "kvferry's own variable wins"
        );
        assert!(!cfg(&[("KVFERRY_AUTO_RDMA", "off")]).unwrap().auto_rdma);
        assert!(cfg(&[("KVFERRY_AUTO_RDMA", "maybe")])
            .unwrap_err()
            .to_string()
            .contains("KVFERRY_AUTO_RDMA"));
        let e = cfg(&[("KVFERRY_TRANSPORT", "verbs")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KVFERRY_TRANSPORT") && e.contains("auto, tcp, shm or rdma"),
            "{e}"
        );
        let c = cfg(&[
            ("MC_GID_INDEX", "3"),
            ("KVFERRY_RDMA_DEVICES", "mlx5_0, mlx5_1"),
        ])
        .unwrap();
        assert_eq!(
            (c.gid_index, c.rdma_devices),
            (
                Some(3),
                Some(vec!["mlx5_0".to_string(), "mlx5_1".to_string()])
            )
        );
        assert_eq!(Config::default().rdma_max_endpoints, 256);
        assert_eq!(
            (
                Config::default().rdma_retry_cnt,
                cfg(&[("KVFERRY_RDMA_RETRY_CNT", "6")])
                    .unwrap()
                    .rdma_retry_cnt
            ),
            (7, 6)
        );
        assert!(cfg(&[("KVFERRY_RDMA_RETRY_CNT", "8")])
            .unwrap_err()
            .to_string()
            .contains("0 to 7"));
        use crate::gpu::direct::GpuRdma;
        assert_eq!(Config::default().gpu_rdma, GpuRdma::Auto);
        assert_eq!(
            cfg(&[("WITH_NVIDIA_PEERMEM", "1")]).unwrap().gpu_rdma,
            GpuRdma::PeerMem,
            "Mooncake's switch to plain ibv_reg_mr"
        );
        assert_eq!(
            cfg(&[("WITH_NVIDIA_PEERMEM", "0")]).unwrap().gpu_rdma,
            GpuRdma::DmaBuf
        );
        assert_eq!(
            cfg(&[("WITH_NVIDIA_PEERMEM", "1"), ("KVFERRY_GPU_RDMA", "auto")])
                .unwrap()
                .gpu_rdma,
            GpuRdma::Auto,
            "ours wins"
        );
        assert!(cfg(&[("KVFERRY_GPU_RDMA", "gdr")])
            .unwrap_err()
            .to_string()
            .contains("auto, dmabuf or peermem"));
        assert_eq!(
            cfg(&[("KVFERRY_RDMA_MAX_ENDPOINTS", "4")])
                .unwrap()
                .rdma_max_endpoints,
            4
        );
        assert_eq!(Config::default().rdma_max_passive_qps, 16384);
        assert_eq!(
            cfg(&[("KVFERRY_RDMA_MAX_PASSIVE_QPS", "8")])
                .unwrap()
                .rdma_max_passive_qps,
            8
        );
        assert!(cfg(&[("KVFERRY_RDMA_MAX_PASSIVE_QPS", "0")])
            .unwrap_err()
            .to_string()
            .contains("1 to 1048576"));
        let e = cfg(&[("KVFERRY_RDMA_MAX_ENDPOINTS", "0")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KVFERRY_RDMA_MAX_ENDPOINTS=0") && e.contains("1 to 65536"),
            "{e}"
        );
        assert!(cfg(&[("MC_GID_INDEX", "x")]).is_err());
        assert!(cfg(&[("KVFERRY_SHM_THREADS", "65")]).is_err());
    }

    /// Issue 45: Mooncake's `initialize(..., protocol, device_name)` on the configuration.
    fn init(
        vars: &[(&str, &str)],
        protocol: &str,
        device_name: &str,
    ) -> Result<(Config, InitializeArgs)> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let get = move |k: &str| m.get(k).cloned();
        let mut c = Config::from_lookup(&get)?;
        let a = c.apply_initialize_args(protocol, device_name, &get)?;
        Ok((c, a))
    }

    #[test]
    fn initialize_protocol_and_device_name_map_onto_the_config() {
        // protocol "rdma": RDMA only (an RDMA descriptor); "tcp", "" and others: as configured.
        let (c, a) = init(&[], "rdma", "").unwrap();
        assert_eq!((c.transport, a.rdma_required), (TransportMode::Rdma, true));
        assert_eq!(c.rdma_devices, None, "every NIC with an active port");
        let (c, _) = init(&[], " RDMA ", "").unwrap();
        assert_eq!(c.transport, TransportMode::Rdma);
        for p in ["tcp", "", "nvlink"] {
            let (c, a) = init(&[], p, "").unwrap();
            assert_eq!(
                (c.transport, a.rdma_required),
                (TransportMode::Auto, false),
                "{p}"
            );
            assert!(c.auto_rdma, "{p}");
        }
        // An explicit KVFERRY_TRANSPORT wins; so does Mooncake's MC_FORCE_TCP (TCP only).
        let (c, a) = init(&[("KVFERRY_TRANSPORT", "tcp")], "rdma", "").unwrap();
        assert_eq!((c.transport, a.rdma_required), (TransportMode::Tcp, false));
        let (c, _) = init(&[("KVFERRY_TRANSPORT", "rdma")], "tcp", "").unwrap();
        assert_eq!(c.transport, TransportMode::Rdma);
        let (c, a) = init(&[("MC_FORCE_TCP", "1")], "rdma", "").unwrap();
        assert_eq!((c.transport, a.rdma_required), (TransportMode::Auto, false));
        assert!(!c.auto_rdma, "MC_FORCE_TCP keeps auto off RDMA");
        let (c, _) = init(&[("MC_FORCE_TCP", "0")], "rdma", "").unwrap();
        assert_eq!(c.transport, TransportMode::Rdma);
        let (c, _) = init(
            &[("MC_FORCE_TCP", "1"), ("KVFERRY_TRANSPORT", "rdma")],
            "rdma",
            "",
        )
        .unwrap();
        assert_eq!(
            c.transport,
            TransportMode::Rdma,
            "kvferry's own variable wins"
        );

        // device_name: NIC names, comma-separated (spaces and empty items dropped).
        let (c, a) = init(&[], "rdma", "mlx5_0, mlx5_1,").unwrap();
        let both = vec!["mlx5_0".to_string(), "mlx5_1".to_string()];
        assert_eq!(c.rdma_devices.as_ref(), Some(&both));
        assert_eq!(a.device_names.as_ref(), Some(&both));
        let (c, _) = init(&[], "tcp", "mlx5_1").unwrap();
        assert_eq!(
            c.rdma_devices,
            Some(vec!["mlx5_1".to_string()]),
            "auto's RDMA (as initiator) uses those NICs only"
        );
        for every in ["", " , ", "auto-discovery"] {
            assert_eq!(
                init(&[], "rdma", every).unwrap().0.rdma_devices,
                None,
                "{every:?}"
            );
        }
        // With MC_TE_FILTERS (KVFERRY_RDMA_DEVICES) too: the NICs both name, as in Mooncake.
        let (c, a) = init(
            &[("MC_TE_FILTERS", "mlx5_1,mlx5_2")],
            "rdma",
            "mlx5_0,mlx5_1",
        )
        .unwrap();
        assert_eq!(c.rdma_devices, Some(vec!["mlx5_1".to_string()]));
        assert_eq!(
            a.env_filter,
            Some(("MC_TE_FILTERS".to_string(), "mlx5_1,mlx5_2".to_string()))
        );
        let (c, _) = init(&[("KVFERRY_RDMA_DEVICES", "mlx5_2")], "rdma", "mlx5_0").unwrap();
        assert_eq!(
            c.rdma_devices,
            Some(Vec::new()),
            "no NIC left: RDMA cannot open"
        );
        let (c, _) = init(&[("KVFERRY_RDMA_DEVICES", "mlx5_2")], "rdma", "").unwrap();
        assert_eq!(c.rdma_devices, Some(vec!["mlx5_2".to_string()]));
        // A NIC priority matrix is not a list of names (Mooncake's initialize takes names).
        for json in [r#"{"cpu:0": [["mlx5_0"], []]}"#, "/etc/topo.json"] {
            let e = init(&[], "rdma", json).unwrap_err().to_string();
            assert!(
                e.contains("device_name")
                    && e.contains("comma-separated")
                    && e.contains("KVFERRY_RDMA_TOPO"),
                "{e}"
            );
        }
    }

    /// `protocol="rdma"` where the host cannot do RDMA: an error naming the cause and the fix
    /// (a made-up host each time, so this runs anywhere).
    #[test]
    fn initialize_rdma_without_usable_nics_says_why_and_what_to_do() {
        use crate::nic::{sysfs, Probe};
        let nic = |name: &str, active: bool| sysfs::Nic {
            name: name.into(),
            numa_node: None,
            ports: vec![sysfs::Port {
                num: 1,
                state: if active { "4: ACTIVE" } else { "1: DOWN" }.into(),
                active,
                rate: String::new(),
                link_layer: "Ethernet".into(),
                gids: Vec::new(),
            }],
        };
        let host = |nics: Vec<sysfs::Nic>| Probe {
            library: true,
            verbs: Ok(nics.iter().map(|n| n.name.clone()).collect()),
            nics,
        };
        let check = |vars: &[(&str, &str)], dev: &str, p: &Probe| {
            let (c, a) = init(vars, "rdma", dev).unwrap();
            a.check_rdma(p, c.rdma_devices.as_deref())
        };
        let fix = |e: &str| {
            e.contains("protocol=\"rdma\"")
                && e.contains("RDMA only")
                && e.contains("Fix:")
                && e.contains("protocol=\"tcp\"")
                && e.contains("kvferry doctor")
        };
        // No RDMA at all (libibverbs missing, or no device).
        let none = Probe {
            library: false,
            verbs: Err("libibverbs.so.1 cannot be loaded: not found".into()),
            nics: Vec::new(),
        };
        let e = check(&[], "", &none).unwrap_err().to_string();
        assert!(
            fix(&e) && e.contains("libibverbs.so.1 cannot be loaded"),
            "{e}"
        );
        let e = check(&[], "", &host(Vec::new())).unwrap_err().to_string();
        assert!(fix(&e) && e.contains("lists no RDMA device"), "{e}");
        // NICs, but the port is down, or device_name names others.
        let down = host(vec![nic("mlx5_0", false)]);
        let e = check(&[], "", &down).unwrap_err().to_string();
        assert!(fix(&e) && e.contains("no port is ACTIVE"), "{e}");
        let two = host(vec![nic("mlx5_0", true), nic("mlx5_1", false)]);
        let e = check(&[], "mlx5_1,mlx5_9", &two).unwrap_err().to_string();
        assert!(
            fix(&e)
                && e.contains("device_name=\"mlx5_1,mlx5_9\"")
                && e.contains("this host has: mlx5_0, mlx5_1 (no ACTIVE port)"),
            "{e}"
        );
        let e = check(&[("MC_TE_FILTERS", "mlx5_1")], "mlx5_0", &two)
            .unwrap_err()
            .to_string();
        assert!(
            fix(&e) && e.contains("MC_TE_FILTERS=\"mlx5_1\" allows []"),
            "{e}"
        );
        // A usable NIC among those allowed: the engine opens it.
        assert!(check(&[], "", &two).is_ok());
        assert!(check(&[], "mlx5_0", &two).is_ok());
        // Not RDMA-only: nothing to check.
        let (c, a) = init(&[], "tcp", "").unwrap();
        assert!(a.check_rdma(&none, c.rdma_devices.as_deref()).is_ok());
        let (c, a) = init(&[("MC_FORCE_TCP", "1")], "rdma", "").unwrap();
        assert!(a.check_rdma(&none, c.rdma_devices.as_deref()).is_ok());
    }

    #[test]
    fn host_port_split() {
        assert_eq!(split_host_port("10.0.0.1:15000"), ("10.0.0.1", Some(15000)));
        assert_eq!(split_host_port("node1"), ("node1", None));
        assert_eq!(split_host_port("[::1]:80"), ("::1", Some(80)));
        assert_eq!(split_host_port("::1"), ("::1", None));
        assert_eq!(split_host_port("/10.0.0.1:5"), ("10.0.0.1", Some(5)));
    }
}
