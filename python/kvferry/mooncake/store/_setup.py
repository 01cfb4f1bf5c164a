"""``MooncakeDistributedStore.setup`` and its forms (dict, dummy client), and
``alloc_from_mem_pool``."""

from __future__ import annotations

from typing import Any, Dict

from ... import _kvferry
from ... import store as _native
from ._common import _MAX_SEGMENT, _MIN_SEGMENT, _fail, _log, _logged, _parse_bool, _parse_size
from ._types import INVALID_PARAMS

# setup(dict)'s keys: Mooncake 0.3.14's (its docstring's list) and kvferry's aliases.
_DICT_KEYS = frozenset((
    "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol", "rdma_devices", "device_name",
    "master_server_addr", "master_server_address", "enable_egm_store_pool", "egm_numa_nodes", "ipc_socket_path",
    "enable_ssd_offload", "ssd_offload_path", "tenant_id", "enable_client_http_server", "client_http_port",
    "enable_ssd_prefetch", "ssd_prefetch_cooldown_sec", "ssd_prefetch_dedup_ttl_sec", "enable_embedded_master",
))
# Keys accepted with one warning line: what kvferry does instead.
_DICT_NO_EFFECT = {
    "egm_numa_nodes": "no EGM memory pool (enable_egm_store_pool stays false)",
    "ipc_socket_path": "dummy clients reach `kvferry store-client` over its TCP service (setup_dummy)",
    "client_http_port": "used only with enable_client_http_server",
    "enable_ssd_prefetch": "no SSD-to-memory prefetch: a get reads a key held only on disk from there",
    "ssd_prefetch_cooldown_sec": "no SSD-to-memory prefetch",
    "ssd_prefetch_dedup_ttl_sec": "no SSD-to-memory prefetch",
}
# Of those, the booleans that only warn when true.
_DICT_NO_EFFECT_IF_FALSE = frozenset(("enable_ssd_prefetch",))


class _Setup:
    """Mixed into MooncakeDistributedStore."""

    _s: Any
    _local_buffer_size: int
    _protocol: str
    _scratch_buf: Any

    def setup(
        self,
        local_hostname: Any = None,
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
        enable_embedded_master: bool = False,
    ) -> int:
        """0 on success, a negative error number otherwise (as Mooncake: it does not raise).
        Also accepts one dict with the same keys (Mooncake's dict form; sizes may be
        human-readable: "16MB", "1.5 GB").

        Keyword arguments kvferry cannot honour raise TypeError naming the argument:
        ``tenant_id`` other than "default", ``enable_client_http_server=True``.

        ``enable_ssd_offload=True`` gives this client a disk tier on ``ssd_offload_path``
        (empty: ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``; its size limit, staging buffer and
        beat from the other ``MOONCAKE_OFFLOAD_*`` variables): with a master started with
        ``--enable_offload``, what eviction takes from this client's segment is kept there
        and gets read it back through this client.

        ``engine`` (an initialized kvferry.mooncake.engine.TransferEngine, or kvferry.Engine)
        is shared as in Mooncake: no second engine starts, the store's segment is the
        engine's own (``get_hostname()`` is the engine's segment name), and memory registered
        on the engine serves the store and the other way round. ``local_hostname`` must be
        the engine's segment name or its host (otherwise -600: the segment can only carry the
        engine's name). close() leaves the engine running; closing the engine first makes
        every store call fail (-600, "the transfer engine this store shares was closed")
        until the store is closed.

        ``enable_embedded_master=True`` (Mooncake 0.3.14) starts a kvferry master in this
        process, listening on 127.0.0.1 at a port the kernel picks, and sets the store up
        against it (``master_server_addr`` is then unused, as in stock 0.3.14: its embedded
        master does not take that port either); close() stops it. Other processes cannot
        reach that master unless they are given its address (``embedded_master_address``).
        Mooncake calls this test/eval plumbing, not a deployment mode."""
        if isinstance(local_hostname, dict):
            return self._setup_dict(local_hostname)
        if str(tenant_id) != "default":
            raise TypeError("setup(tenant_id=%r): kvferry's store has no tenants (one key space per master); pass 'default' or run one master per tenant" % (tenant_id,))
        if enable_client_http_server:
            raise TypeError("setup(enable_client_http_server=True): kvferry's store client has no HTTP server; pass False (client_http_port is then unused)")
        if engine is not None:
            self._check_engine(engine)
        if local_hostname is None:
            return _fail(_native.StoreInvalidArgument("local_hostname is required", INVALID_PARAMS))
        if not isinstance(enable_embedded_master, bool):
            raise TypeError("setup(enable_embedded_master=%r): a bool" % (enable_embedded_master,))
        embedded = None
        try:
            if enable_embedded_master:
                embedded = _kvferry.EmbeddedMaster("127.0.0.1")
                master_server_addr = embedded.address
            offload = str(ssd_offload_path or "") if _parse_bool(enable_ssd_offload, False) else None
            self._s = _native.Store(str(local_hostname), metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices or "", master_server_addr, engine, offload)
            self._local_buffer_size = int(local_buffer_size)
            self._protocol = str(protocol)
            self._scratch_buf = None
            self._embedded, embedded = embedded, None
            return 0
        except Exception as e:  # noqa: BLE001 - the compatible API reports codes
            return _fail(e)
        finally:
            if embedded is not None:
                embedded.shutdown()

    @property
    def embedded_master_address(self) -> str:
        """``host:port`` of the master ``setup(enable_embedded_master=True)`` started, else ""
        (kvferry's: stock Mooncake only logs it)."""
        m = getattr(self, "_embedded", None)
        return m.address if m is not None else ""

    @staticmethod
    def _check_engine(engine: Any) -> None:
        from ..._engine import Engine
        from ..engine import TransferEngine

        if not isinstance(engine, (TransferEngine, Engine)):
            raise TypeError("setup(engine=...) takes a TransferEngine (kvferry.mooncake.engine.TransferEngine or its get_engine()), not %s" % type(engine).__name__)

    def _setup_dict(self, config: Dict[Any, Any]) -> int:
        # Mooncake converts every value with str() and parses it (setup_internal(ConfigDict)).
        d = {str(k): v for k, v in config.items()}
        host = str(d.get("local_hostname", "") or "")
        meta = str(d.get("metadata_server", "") or "")
        if not host or not meta:
            return _fail(_native.StoreInvalidArgument("setup(dict) needs local_hostname and metadata_server", INVALID_PARAMS))
        sizes = {}
        for key in ("global_segment_size", "local_buffer_size"):
            if key not in d:
                sizes[key] = 16 << 20
                continue
            n = _parse_size(d[key])
            if n is None:
                return _fail(_native.StoreInvalidArgument("setup(dict): %s=%r is not a size (bytes, or a number with B/KB/MB/GB/TB)" % (key, d[key]), INVALID_PARAMS))
            sizes[key] = n
        if 0 < sizes["global_segment_size"] < _MIN_SEGMENT:
            return _fail(_native.StoreInvalidArgument("setup(dict): global_segment_size must be 0 or at least %d bytes" % _MIN_SEGMENT, INVALID_PARAMS))
        if 0 < sizes["local_buffer_size"] < _MIN_SEGMENT or sizes["local_buffer_size"] > _MAX_SEGMENT:
            return _fail(_native.StoreInvalidArgument("setup(dict): local_buffer_size must be 0 or between %d and %d bytes" % (_MIN_SEGMENT, _MAX_SEGMENT), INVALID_PARAMS))
        unknown = sorted(k for k in d if k not in _DICT_KEYS)
        if unknown:
            return _fail(_native.StoreInvalidArgument(
                "setup(dict): unknown key%s %s (kvferry refuses keys it does not know rather than ignore them; Mooncake 0.3.14's keys: %s)"
                % ("" if len(unknown) == 1 else "s", ", ".join(unknown), ", ".join(sorted(_DICT_KEYS))), INVALID_PARAMS))
        if _parse_bool(d.get("enable_egm_store_pool", False), False):
            return _fail(_native.StoreInvalidArgument("setup(dict): enable_egm_store_pool: kvferry has no NVLink/EGM memory pool; leave it false", INVALID_PARAMS))
        for key in sorted(_DICT_NO_EFFECT):
            if key in d and (key not in _DICT_NO_EFFECT_IF_FALSE or _parse_bool(d[key], False)):
                msg = "setup(dict): %s=%r has no effect on kvferry: %s" % (key, d[key], _DICT_NO_EFFECT[key])
                if msg not in _logged:
                    _logged.add(msg)
                    _log.warning("kvferry store: %s", msg)
        if str(d.get("tenant_id", "default")) != "default":
            return _fail(_native.StoreInvalidArgument("setup(dict): tenant_id: kvferry's store has no tenants (one key space per master)", INVALID_PARAMS))
        if _parse_bool(d.get("enable_client_http_server", False), False):
            return _fail(_native.StoreInvalidArgument("setup(dict): enable_client_http_server: kvferry's store client has no HTTP server", INVALID_PARAMS))
        return self.setup(
            host,
            meta,
            sizes["global_segment_size"],
            sizes["local_buffer_size"],
            str(d.get("protocol", "tcp")),
            str(d.get("rdma_devices", d.get("device_name", ""))),
            str(d.get("master_server_addr", d.get("master_server_address", "127.0.0.1:50051"))),
            enable_embedded_master=_parse_bool(d.get("enable_embedded_master", False), False),
            enable_ssd_offload=_parse_bool(d.get("enable_ssd_offload", False), False),
            ssd_offload_path=str(d.get("ssd_offload_path", "") or ""),
        )

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int, /) -> int:
        """Mooncake's test plumbing: ``setup("localhost:12345", "127.0.0.1:2379",
        mount_segment_size, 1 GiB, protocol, device_name, "127.0.0.1:50051")`` (its fixed
        hostname, etcd metadata service and master address). -600 when this store is set up
        already, as Mooncake's."""
        if self._s is not None:
            return _fail(_native.StoreInvalidArgument("init_all: the client is already set up", INVALID_PARAMS))
        return self.setup("localhost:12345", "127.0.0.1:2379", int(mount_segment_size), 1 << 30, str(protocol), str(device_name), "127.0.0.1:50051")

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy-client mode: join the pool served by the ``kvferry store-client``
        (Mooncake's ``mooncake_client``) whose dummy-client service is at ``server_address``
        (``host:port``, its ``--port``, 50052 by default). 0 on success; -1 when the service
        cannot be reached or answers something else (logged, as Mooncake does).

        The store-client tells which master, metadata service and protocol it uses; this
        client then sets up against them with no segment of its own (its values land in the
        store-client's segment and the pool's others) and ``local_buffer_size`` bytes for the
        bytes API. Unlike Mooncake's dummy clients, requests do not go through the
        store-client: this process moves the bytes with its own transfer engine (same-host
        shared memory or TCP). ``mem_pool_size`` is accepted and unused (Mooncake's current
        dummy client ignores it too); ``alloc_from_mem_pool`` hands out memory that same-host
        peers map."""
        import json
        import socket

        try:
            host, _, port = str(server_address).rpartition(":")
            host = host.strip("[]") or "127.0.0.1"
            with socket.create_connection((host, int(port)), timeout=5.0) as sock:
                sock.settimeout(5.0)
                sock.sendall(b"KVFERRY-DUMMY 1\n")
                data = b""
                while not data.endswith(b"\n") and len(data) < 65536:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            info = json.loads(data.decode("utf-8", "replace"))
        except (OSError, ValueError) as e:
            _log.error("kvferry: setup_dummy: cannot reach the dummy-client service at %r (%s): is `kvferry store-client --port=<port>` running on this host?", server_address, e)
            return -1
        if not isinstance(info, dict) or "error" in info or "master_server_address" not in info:
            _log.error("kvferry: setup_dummy: %r is not a kvferry store-client's dummy-client service (it answered %.200r)", server_address, info)
            return -1
        return self.setup(
            str(info.get("host") or "127.0.0.1"),
            str(info.get("metadata_server") or "P2PHANDSHAKE"),
            0,
            int(local_buffer_size),
            str(info.get("protocol") or "tcp"),
            "",
            str(info["master_server_address"]),
        )

    def alloc_from_mem_pool(self, size: int) -> int:
        """``size`` bytes of zero-filled memory from kvferry's allocator (shareable: same-host
        peers map it), to ``register_buffer`` and use with put_from/get_into; its address, or 0
        (logged) before setup or when the memory cannot be had. Valid while this store
        object lives."""
        if self._s is None:
            _log.error("kvferry: alloc_from_mem_pool(%r) before setup() or setup_dummy()", size)
            return 0
        try:
            return int(self._store()._core.alloc_from_mem_pool(int(size)))
        except Exception as e:  # noqa: BLE001
            _log.error("kvferry: alloc_from_mem_pool(%r) failed: %s", size, e)
            return 0

