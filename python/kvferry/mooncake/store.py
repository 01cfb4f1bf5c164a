"""Mooncake's ``mooncake.store`` API on kvferry: ``MooncakeDistributedStore``,
``ReplicateConfig``, ``SoftPinAction``, with Mooncake's return conventions (0 or a negative
error number; ``get`` of a missing key returns ``b""``; ``is_exist`` 1/0/-1).

The master is ``kvferry master`` (its own protocol, not ``mooncake_master``'s). Mooncake
0.3.13 names that kvferry does not provide raise AttributeError / NotImplementedError naming
kvferry; docs/PYTHON.md has the name-by-name table."""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import logging
import operator
import os
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import store as _native
from .buffer_pool import BufferLease, BufferPool, RegisteredBufferLease, RegisteredBufferPool
from ._tensor import TensorMethods, deserialize_tensor as _deserialize_tensor, serialize_tensor as _serialize_tensor, tensor_metadata_size as _tensor_metadata_size  # noqa: F401 - Mooncake's private exports

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
    "ReplicaStatus",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "Descriptor",
    "BufferHandle",
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "RegisteredBufferLease",
    "bind_to_numa_node",
]

_log = logging.getLogger("kvferry")
_logged: set = set()

SoftPinAction = _native.SoftPinAction

INVALID_PARAMS = -600
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
OBJECT_ALREADY_EXISTS = -705
OBJECT_NOT_FOUND = -704

# health_check() answers (Mooncake's HC_*).
HC_HEALTHY = 0
HC_NOT_INITIALIZED = 1
HC_MASTER_UNREACHABLE = 2

_U64 = 1 << 64


class ObjectDataType(enum.IntEnum):
    """Mooncake's ``ObjectDataType`` (``ReplicateConfig.data_type``; kvferry stores it nowhere)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    """Mooncake's ``ReplicaStatus``."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


# Mooncake exports these enums' values at module level too (export_values()).
globals().update({m.name: m for m in ObjectDataType})
globals().update({m.name: m for m in ReplicaStatus})
__all__ += [m.name for m in ObjectDataType] + [m.name for m in ReplicaStatus]


class Descriptor:
    """Mooncake's ``Descriptor`` (``AllocatedBuffer::Descriptor``): one replica's bytes,
    ``size`` bytes at ``buffer_address`` in the transfer-engine segment
    ``transport_endpoint``."""

    __slots__ = ("size", "buffer_address", "transport_endpoint")

    def __init__(self) -> None:
        self.size = 0
        self.buffer_address = 0
        self.transport_endpoint = ""

    def __repr__(self) -> str:
        return "<Descriptor size=%d buffer_address=%d transport_endpoint=%s>" % (self.size, self.buffer_address, self.transport_endpoint)


class MemoryDescriptor:
    """Mooncake's ``MemoryDescriptor``: a memory replica's ``buffer_descriptor``."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Optional[Descriptor] = None) -> None:
        self.buffer_descriptor = buffer_descriptor if buffer_descriptor is not None else Descriptor()

    def __repr__(self) -> str:
        return "<MemoryDescriptor %r>" % (self.buffer_descriptor,)


class DiskDescriptor:
    """Mooncake's ``DiskDescriptor`` (``file_path``, ``object_size``): a shared-storage
    replica's. kvferry's disk tier is local to each client (``LOCAL_DISK`` replicas, which
    Mooncake gives no descriptor either), so no replica it returns has one."""

    __slots__ = ("file_path", "object_size")

    def __init__(self) -> None:
        self.file_path = ""
        self.object_size = 0


class ReplicaDescriptor:
    """Mooncake's ``ReplicaDescriptor``, as ``get_replica_desc`` returns it: ``status`` (a
    ``ReplicaStatus``; kvferry lists complete replicas only), ``is_memory_replica()``,
    ``is_disk_replica()`` (False: kvferry has no shared-storage tier),
    ``is_local_disk_replica()`` (a copy on a client's disk, from ``enable_ssd_offload``),
    ``get_memory_descriptor()`` (a memory replica's); ``get_disk_descriptor()`` raises
    RuntimeError, as Mooncake's does for a memory or local-disk replica, and so does
    ``get_memory_descriptor()`` for a local-disk one."""

    __slots__ = ("_status", "_memory", "_local_disk")

    def __init__(self, transport_endpoint: str, buffer_address: int, size: int, status: "ReplicaStatus" = None, local_disk: bool = False) -> None:  # type: ignore[assignment]
        d = Descriptor()
        d.transport_endpoint, d.buffer_address, d.size = str(transport_endpoint), int(buffer_address), int(size)
        self._memory = MemoryDescriptor(d)
        self._status = ReplicaStatus.COMPLETE if status is None else ReplicaStatus(status)
        self._local_disk = bool(local_disk)

    @property
    def status(self) -> "ReplicaStatus":
        return self._status

    def is_memory_replica(self) -> bool:
        return not self._local_disk

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return self._local_disk

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._local_disk:
            raise RuntimeError("get_memory_descriptor: this is a local disk replica; check is_memory_replica() first")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("get_disk_descriptor: this is a %s replica (kvferry has no shared-storage tier); check is_disk_replica() first" % ("local disk" if self._local_disk else "memory"))

    def __repr__(self) -> str:
        kind = "LOCAL_DISK " if self._local_disk else ""
        return "<ReplicaDescriptor %sstatus=%s %r>" % (kind, self._status.name, self._memory.buffer_descriptor)


def _u64_or_none(name: str, v: Any) -> Optional[int]:
    if v is None:
        return None
    try:
        n = None if isinstance(v, bool) else operator.index(v)  # ints, numpy integers
    except TypeError:
        n = None
    if n is None or not 0 <= n < _U64:
        raise TypeError("ReplicateConfig.%s must be None or an integer in [0, 2**64), not %r" % (name, v))
    return n


@dataclasses.dataclass
class ReplicateConfig(_native.ReplicateConfig):
    """Mooncake's ReplicateConfig: same fields and defaults (``soft_pin_action`` is
    ``SoftPinAction.PRESERVE``, ``group_ids`` None), and the same checks: ``soft_pin_ttl_ms``
    outside [0, 2**64) or a ``soft_pin_action`` that is not a SoftPinAction raises TypeError
    when set; a TTL with an action other than ENABLE makes the write return -600.

    ``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``,
    ``prefer_alloc_in_same_node`` and ``data_type`` are accepted and have no effect (kvferry
    has no NVMe-oF/DFS tiers). ``with_soft_pin=True`` (older Mooncake) means ENABLE."""

    soft_pin_action: Any = SoftPinAction.PRESERVE
    nof_replica_num: int = 0
    dfs_replica_num: int = 0
    preferred_nof_segments: List[str] = dataclasses.field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    data_type: Any = ObjectDataType.UNKNOWN
    group_ids: Optional[List[str]] = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "soft_pin_ttl_ms":
            value = _u64_or_none(name, value)
        elif name in ("replica_num", "nof_replica_num", "dfs_replica_num"):
            if _u64_or_none(name, value) is None:
                raise TypeError("ReplicateConfig.%s must be an integer in [0, 2**64), not None" % name)
        elif name == "soft_pin_action":
            if isinstance(value, bool) or not isinstance(value, int) or value not in tuple(SoftPinAction):
                raise TypeError("ReplicateConfig.soft_pin_action must be a SoftPinAction (PRESERVE, ENABLE, DISABLE), not %r" % (value,))
            value = SoftPinAction(value)
        super().__setattr__(name, value)

    def _native(self) -> tuple:
        action = SoftPinAction(self.soft_pin_action)
        if action == SoftPinAction.PRESERVE and self.with_soft_pin:
            action = SoftPinAction.ENABLE
        if self.soft_pin_ttl_ms is not None and action != SoftPinAction.ENABLE:
            raise _native.StoreInvalidArgument(
                "soft_pin_ttl_ms=%d needs soft_pin_action=SoftPinAction.ENABLE (a TTL with %s is refused, as Mooncake does)" % (self.soft_pin_ttl_ms, action.name),
                INVALID_PARAMS,
            )
        group = self.group_id
        if self.group_ids:
            groups = set(str(g) for g in self.group_ids)
            if len(groups) > 1:
                raise _native.StoreInvalidArgument(
                    "ReplicateConfig.group_ids with different groups per key is not supported by kvferry yet: give every key the same group (or one call per group)",
                    INVALID_PARAMS,
                )
            group = groups.pop() or None
        prefs = ([self.preferred_segment] if self.preferred_segment else []) + list(self.preferred_segments)
        n = _native.as_u64(self.replica_num, "replica_num")
        return (n, int(action), self.soft_pin_ttl_ms, bool(self.with_hard_pin), prefs, group)


class BufferHandle(bytearray):
    """A value read by ``get_buffer``/``batch_get_buffer``: supports the buffer protocol
    (``memoryview(h)``, ``numpy.frombuffer(h, ...)``), ``len(h)``, ``h.size()`` and ``h.ptr()``
    (its address) like Mooncake's BufferHandle. The bytes are this object's own copy, made
    once from where the value landed in the client's local buffer (Mooncake hands out the
    local buffer's block itself; a copy here lets a handle outlive the client)."""

    def ptr(self) -> int:
        if not len(self):
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        return len(self)


def _parse_size(v: Any) -> Optional[int]:
    """Mooncake's try_string_to_byte_size: "16777216", "16MB", "16 mb", "1.5 GB", "infinite";
    None for what it cannot parse ("50%", "-1", "")."""
    s = str(v).strip()
    if not s:
        return None
    if s == "infinite":
        return _U64 - 1
    m = re.match(r"[+-]?(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)", s)
    if not m:
        return None
    value = float(m.group(0))
    if value < 0:
        return None
    unit = s[m.end():].strip().upper()
    mult = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}.get(unit)
    if mult is None:
        return None
    return min(int(value * mult), _U64 - 1)


def _parse_bool(v: Any, default: bool) -> bool:
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    _log.warning("kvferry store: invalid boolean %r, using %s", v, default)
    return default


_MIN_SEGMENT = 1024
_MAX_SEGMENT = 1 << 40


def _code(e: BaseException) -> int:
    code = getattr(e, "code", None)
    return code if isinstance(code, int) and code < 0 else INTERNAL_ERROR


def _fail(e: BaseException) -> int:
    msg = "%s: %s" % (type(e).__name__, e)
    if msg not in _logged:
        _logged.add(msg)
        _log.warning("kvferry store: %s", msg)
    return _code(e)


def _put_fail(e: BaseException) -> int:
    """A put of a key that exists succeeds and keeps the stored value (Mooncake's Put and
    BatchPut treat OBJECT_ALREADY_EXISTS as success); use upsert to replace."""
    return 0 if isinstance(e, _native.ObjectAlreadyExists) else _fail(e)


def _put_code(code: int) -> int:
    """A per-key put result: -705 (the key exists) counts as success, as in Mooncake."""
    return 0 if code == OBJECT_ALREADY_EXISTS else code


def _ptr(p: Any) -> int:
    if isinstance(p, bool) or not isinstance(p, int):
        raise _native.StoreInvalidArgument("buffer pointers are ints", INVALID_PARAMS)
    return p


class MooncakeDistributedStore(TensorMethods):
    """Mooncake Store's Python client API (the torch tensor calls: ``_tensor.py``)."""

    def __init__(self) -> None:
        self._s: Optional[_native.Store] = None
        self._local_buffer_size = 0
        # A registered buffer for gathered keys the local buffer cannot stage (see _scratch).
        self._scratch_lock = threading.Lock()
        self._scratch_buf: Optional[bytearray] = None
        self._scratch_addr = 0

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
        until the store is closed."""
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
        try:
            offload = str(ssd_offload_path or "") if _parse_bool(enable_ssd_offload, False) else None
            self._s = _native.Store(str(local_hostname), metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices or "", master_server_addr, engine, offload)
            self._local_buffer_size = int(local_buffer_size)
            self._scratch_buf = None
            return 0
        except Exception as e:  # noqa: BLE001 - the compatible API reports codes
            return _fail(e)

    @staticmethod
    def _check_engine(engine: Any) -> None:
        from .._engine import Engine
        from .engine import TransferEngine

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
            enable_ssd_offload=_parse_bool(d.get("enable_ssd_offload", False), False),
            ssd_offload_path=str(d.get("ssd_offload_path", "") or ""),
        )

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

    def _store(self) -> _native.Store:
        if self._s is None:
            raise _native.StoreError("setup() has not succeeded", INTERNAL_ERROR)
        return self._s

    # bytes API
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """0 on success, also when the key exists (the stored value is kept, as in Mooncake)."""
        try:
            self._store().put(key, value, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _put_fail(e)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store().upsert(key, value, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get(self, key: str) -> bytes:
        try:
            return self._store().get(key)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, _native.ObjectNotFound):
                _fail(e)
            return b""

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Optional[ReplicateConfig] = None) -> int:
        """0 when every key is stored (or already existed), else the first error number."""
        try:
            res = self._store()._core.put_batch([_native._key(k) for k in keys], [bytes(v) for v in values], _native._cfg(config), False)
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        for _, code, _ in res:
            c = _put_code(code)
            if c:
                return c
        return 0

    def get_batch(self, keys: Sequence[str]) -> List[bytes]:
        """Values in order; ``b""`` for a missing or failed key."""
        try:
            res = self._store()._core.get_batch([str(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [b"" for _ in keys]
        return [v if code == 0 and v is not None else b"" for v, code, _ in res]

    # zero copy
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._store()._core.register_buffer(_ptr(buffer_ptr), int(size))
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self._store()._core.unregister_buffer(_ptr(buffer_ptr))
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _native._cfg(config), False)
            return 0
        except Exception as e:  # noqa: BLE001
            return _put_fail(e)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _native._cfg(config), True)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, or a negative error number."""
        try:
            return self._store()._core.get_into(str(key), _ptr(buffer_ptr), int(size))
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Optional[ReplicateConfig] = None) -> List[int]:
        try:
            res = self._store()._core.batch_put_from([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes], _native._cfg(config), False)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [_put_code(code) for _, code, msg in res]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        try:
            res = self._store()._core.batch_get_into([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes])
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [int(v) if code == 0 and v is not None else code for v, code, _ in res]

    # queries and removal
    def is_exist(self, key: str) -> int:
        try:
            return 1 if self._store().is_exist(key) else 0
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        try:
            res = self._store()._core.batch_is_exist([str(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [-1] * len(keys)
        return [(1 if v else 0) if code == 0 else -1 for v, code, _ in res]

    def get_size(self, key: str) -> int:
        try:
            return self._store().get_size(key)
        except Exception as e:  # noqa: BLE001
            return _code(e) if isinstance(e, _native.ObjectNotFound) else _fail(e)

    def remove(self, key: str, force: bool = False) -> int:
        try:
            self._store().remove(key, force)
            return 0
        except Exception as e:  # noqa: BLE001
            return _code(e) if isinstance(e, (_native.ObjectNotFound, _native.ObjectHasLease)) else _fail(e)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        try:
            return self._store().remove_by_regex(regex_pattern, force)
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def remove_all(self, force: bool = False) -> int:
        try:
            return self._store().remove_all(force)
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> List[int]:
        """Per key: 0, or a negative error number (-704 missing, -706 leased)."""
        out = []
        for k in keys:
            try:
                self._store().remove(str(k), force)
                out.append(0)
            except Exception as e:  # noqa: BLE001
                out.append(_code(e) if isinstance(e, (_native.ObjectNotFound, _native.ObjectHasLease)) else _fail(e))
        return out

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's codes)."""
        if self._s is None or self._s._core.closed():
            return HC_NOT_INITIALIZED
        try:
            self._s._core.is_exist("kvferry-health-check")
            return HC_HEALTHY
        except _native.MasterUnreachable:
            return HC_MASTER_UNREACHABLE
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return HC_MASTER_UNREACHABLE

    # more of the bytes API
    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: Optional[ReplicateConfig] = None) -> int:
        try:
            _native._raise_first(self._store()._core.put_batch([str(k) for k in keys], [bytes(v) for v in values], _native._cfg(config), True))
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores the concatenation of ``parts`` (bytes-like objects) as one value."""
        return self._parts(key, parts, config, False)

    def upsert_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self._parts(key, parts, config, True)

    def _parts(self, key: str, parts: Sequence[Any], config: Optional[ReplicateConfig], upsert: bool) -> int:
        try:
            value = b"".join(memoryview(p).tobytes() for p in parts)
        except TypeError as e:
            raise TypeError("put_parts(key, *parts): every part must support the buffer protocol (bytes, bytearray, memoryview, numpy): %s" % e) from None
        try:
            self._store()._core.put(str(key), value, _native._cfg(config), upsert)
            return 0
        except Exception as e:  # noqa: BLE001
            return _put_fail(e)

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        """The value as a BufferHandle (buffer protocol), or None if missing or failed."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> List[Optional[BufferHandle]]:
        """Per key: a BufferHandle, or None if missing or failed."""
        try:
            res = self._store()._core.get_buffers([str(k) for k in keys], BufferHandle)
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [None for _ in keys]
        return [v if code == 0 else None for v, code, _ in res]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Optional[ReplicateConfig] = None) -> List[int]:
        try:
            res = self._store()._core.batch_put_from([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes], _native._cfg(config), True)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [0 if code == 0 else code for _, code, _ in res]

    # several buffers per key (MLA, hybrid and draft models: one region per layer group)
    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], config: Optional[ReplicateConfig] = None
    ) -> List[int]:
        """Stores, per key, the concatenation of its buffers. Per key: 0 or a negative error
        number (-200: no space). A key whose buffers lie in registered memory (the usual case:
        a registered KV cache) is written without a copy, each buffer straight into its place
        in the replica; a key with a buffer outside registered memory is gathered through the
        local buffer, in groups of at most half of it, and a key larger than that (or every
        such key when ``local_buffer_size`` is 0) through a registered scratch buffer, one key
        at a time."""
        if self._s is None:
            return []
        try:
            ranges = self._ranges(keys, all_buffer_ptrs, all_sizes)
            cfg = _native._cfg(config)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        out = [0] * len(keys)
        core = self._store()._core
        direct, parts, gather = self._split_by_placement(core, ranges, all_buffer_ptrs, all_sizes)
        put_code = lambda _v, code: _put_code(code)  # noqa: E731
        self._per_key(out, parts, put_code, lambda: core.batch_put_from_parts(
            [str(keys[i]) for i in parts], [[_ptr(p) for p in all_buffer_ptrs[i]] for i in parts], [[int(n) for n in all_sizes[i]] for i in parts], cfg, False))
        self._per_key(out, direct, put_code, lambda: core.batch_put_from(
            [str(keys[i]) for i in direct], [ranges[i][0] for i in direct], [ranges[i][1] for i in direct], cfg, False))
        cap = self._local_buffer_size // 2
        for i in [i for i in gather if ranges[i][1] > cap]:
            try:
                with self._scratch_lock:
                    addr = self._scratch(ranges[i][1])
                    off = 0
                    for p, n in zip(all_buffer_ptrs[i], all_sizes[i]):
                        ctypes.memmove(addr + off, p, int(n))
                        off += int(n)
                    core.put_from(str(keys[i]), addr, off, cfg, False)
                out[i] = 0
            except Exception as e:  # noqa: BLE001
                out[i] = _put_fail(e)
        gather = [i for i in gather if ranges[i][1] <= cap]
        for chunk in self._chunks(gather, [ranges[i][1] for i in gather]):
            try:
                values = [b"".join(ctypes.string_at(p, n) for p, n in zip(all_buffer_ptrs[i], all_sizes[i])) for i in chunk]
                res = core.put_batch([str(keys[i]) for i in chunk], values, cfg, False)
                for i, (_, code, _) in zip(chunk, res):
                    out[i] = _put_code(code)
            except Exception as e:  # noqa: BLE001
                code = _fail(e)
                for i in chunk:
                    out[i] = code
        return out

    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[str]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> List[List[List[int]]]:
        """Copies byte ranges of objects into buffers: for buffer ``i``, key ``j`` and range
        ``r``, ``all_sizes[i][j][r]`` bytes from offset ``all_src_offsets[i][j][r]`` of the
        value of ``all_keys[i][j]`` to ``buffer_ptrs[i] + all_dst_offsets[i][j][r]``. Per range
        (same nesting): the bytes copied, -704 for a missing key, -600 for a range past the
        value's end, a null buffer or lists that do not match. kvferry reads each distinct
        key's whole value once (one batched get) and copies the ranges out of it; the
        destination ranges are not checked against registered memory."""
        n = len(buffer_ptrs)

        def filled(code: int) -> List[List[List[int]]]:
            out = []
            for i in range(n):
                keys_i = all_keys[i] if i < len(all_keys) else []
                dst_i = all_dst_offsets[i] if i < len(all_dst_offsets) else []
                out.append([[code] * (len(dst_i[j]) if j < len(dst_i) else 0) for j in range(len(keys_i))])
            return out

        if not n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            _fail(_native.StoreInvalidArgument(
                "get_into_ranges: %d buffers, %d key lists, %d/%d/%d offset and size lists: one of each per buffer"
                % (n, len(all_keys), len(all_dst_offsets), len(all_src_offsets), len(all_sizes)), INVALID_PARAMS))
            return filled(INVALID_PARAMS)
        try:
            core = self._store()._core
        except Exception as e:  # noqa: BLE001
            return filled(_fail(e))
        out = filled(INVALID_PARAMS)
        wanted: Dict[str, Any] = {}
        for i in range(n):
            keys_i, dst_i, src_i, len_i = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not len(keys_i) == len(dst_i) == len(src_i) == len(len_i):
                _fail(_native.StoreInvalidArgument("get_into_ranges: buffer %d has %d keys but %d/%d/%d range lists" % (i, len(keys_i), len(dst_i), len(src_i), len(len_i)), INVALID_PARAMS))
                continue
            for j, k in enumerate(keys_i):
                if len(dst_i[j]) == len(src_i[j]) == len(len_i[j]):
                    wanted[str(k)] = None
        if wanted:
            try:
                names = list(wanted)
                for k, (v, code, _) in zip(names, core.get_batch(names)):
                    wanted[k] = v if code == 0 and v is not None else (code or INTERNAL_ERROR)
            except Exception as e:  # noqa: BLE001
                code = _fail(e)
                for k in wanted:
                    wanted[k] = code
        for i in range(n):
            try:
                ptr = _ptr(buffer_ptrs[i])
            except Exception as e:  # noqa: BLE001
                _fail(e)
                continue
            if ptr == 0 or len(all_keys[i]) != len(out[i]):
                continue
            for j, k in enumerate(all_keys[i]):
                v = wanted.get(str(k))
                dst, src, sizes = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
                if v is None or not len(dst) == len(src) == len(sizes):
                    continue
                for r, (d, o, m) in enumerate(zip(dst, src, sizes)):
                    if isinstance(v, int):
                        out[i][j][r] = v
                        continue
                    d, o, m = int(d), int(o), int(m)
                    if d < 0 or o < 0 or m < 0 or o + m > len(v):
                        _fail(_native.StoreInvalidArgument("get_into_ranges: %s: range [%d, %d) is past the value's %d bytes" % (k, o, o + m, len(v)), INVALID_PARAMS))
                        out[i][j][r] = INVALID_PARAMS
                        continue
                    if m:
                        ctypes.memmove(ptr + d, v[o:o + m], m)
                    out[i][j][r] = m
        return out

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], prefer_alloc_in_same_node: bool = False
    ) -> List[int]:
        """Reads each key's value across its buffers, in order. Per key: the value's size, or
        a negative error number (-704 missing; -600 when the buffers are smaller than the
        value). Buffers in registered memory are filled straight from the replica, without a
        copy; others through the local buffer or a scratch buffer (see
        ``batch_put_from_multi_buffers``). ``prefer_alloc_in_same_node`` has no effect."""
        try:
            ranges = self._ranges(keys, all_buffer_ptrs, all_sizes)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        out = [0] * len(keys)
        try:
            core = self._store()._core
            direct, parts, gather = self._split_by_placement(core, ranges, all_buffer_ptrs, all_sizes)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        got = lambda v, code: int(v) if code == 0 and v is not None else (INVALID_PARAMS if code == BUFFER_OVERFLOW else code)  # noqa: E731
        self._per_key(out, parts, got, lambda: core.batch_get_into_parts(
            [str(keys[i]) for i in parts], [[_ptr(p) for p in all_buffer_ptrs[i]] for i in parts], [[int(n) for n in all_sizes[i]] for i in parts]))
        self._per_key(out, direct, got, lambda: core.batch_get_into(
            [str(keys[i]) for i in direct], [ranges[i][0] for i in direct], [ranges[i][1] for i in direct]))
        cap = self._local_buffer_size // 2
        for i in [i for i in gather if ranges[i][1] > cap]:
            try:
                with self._scratch_lock:
                    addr = self._scratch(ranges[i][1])
                    got = core.get_into(str(keys[i]), addr, ranges[i][1])
                    off = 0
                    for p, n in zip(all_buffer_ptrs[i], all_sizes[i]):
                        take = min(int(n), got - off)
                        if take <= 0:
                            break
                        ctypes.memmove(p, addr + off, take)
                        off += take
                out[i] = got
            except Exception as e:  # noqa: BLE001
                code = _code(e) if isinstance(e, _native.ObjectNotFound) else _fail(e)
                out[i] = INVALID_PARAMS if code == BUFFER_OVERFLOW else code
        gather = [i for i in gather if ranges[i][1] <= cap]
        for chunk in self._chunks(gather, [ranges[i][1] for i in gather]):
            try:
                res = core.get_batch([str(keys[i]) for i in chunk])
            except Exception as e:  # noqa: BLE001
                code = _fail(e)
                for i in chunk:
                    out[i] = code
                continue
            for i, (v, code, _) in zip(chunk, res):
                if code != 0 or v is None:
                    out[i] = code or INTERNAL_ERROR
                    continue
                if len(v) > ranges[i][1]:
                    _fail(_native.StoreInvalidArgument("%s: the value has %d bytes, its buffers %d" % (keys[i], len(v), ranges[i][1]), INVALID_PARAMS))
                    out[i] = INVALID_PARAMS
                    continue
                off = 0
                for p, n in zip(all_buffer_ptrs[i], all_sizes[i]):
                    take = min(int(n), len(v) - off)
                    if take <= 0:
                        break
                    ctypes.memmove(p, v[off:off + take], take)
                    off += take
                out[i] = len(v)
        return out

    @staticmethod
    def _ranges(keys: Sequence[str], all_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]]) -> List[Tuple[Optional[int], int]]:
        """Per key (start address if its buffers are one contiguous range else None, total)."""
        if len(all_ptrs) != len(keys) or len(all_sizes) != len(keys):
            raise _native.StoreInvalidArgument("%d keys, %d buffer lists, %d size lists: one list of each per key" % (len(keys), len(all_ptrs), len(all_sizes)), INVALID_PARAMS)
        out: List[Tuple[Optional[int], int]] = []
        for k, ptrs, sizes in zip(keys, all_ptrs, all_sizes):
            if len(ptrs) != len(sizes) or not ptrs:
                raise _native.StoreInvalidArgument("%s: %d buffers but %d sizes (at least one of each)" % (k, len(ptrs), len(sizes)), INVALID_PARAMS)
            ps = [_ptr(p) for p in ptrs]
            ns = [int(n) for n in sizes]
            if any(n < 0 for n in ns):
                raise _native.StoreInvalidArgument("%s: negative size" % k, INVALID_PARAMS)
            contiguous = all(ps[j] + ns[j] == ps[j + 1] for j in range(len(ps) - 1))
            out.append((ps[0] if contiguous else None, sum(ns)))
        return out

    @staticmethod
    def _per_key(out: List[int], idx: List[int], code_of: Any, call: Any) -> None:
        """Runs the native batch ``call()`` for the keys at ``idx`` and stores
        ``code_of(value, code)`` of each answer in ``out``; if the call itself raises, every
        one of those keys gets its error code."""
        if not idx:
            return
        try:
            for i, (v, code, _) in zip(idx, call()):
                out[i] = code_of(v, code)
        except Exception as e:  # noqa: BLE001
            code = _fail(e)
            for i in idx:
                out[i] = code

    @staticmethod
    def _split_by_placement(core: Any, ranges: List[Tuple[Optional[int], int]], all_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]]) -> Tuple[List[int], List[int], List[int]]:
        """Key indices: (one contiguous range in registered memory, moved as one piece),
        (scattered buffers all in registered memory, moved part by part without a copy), (the
        rest, contiguous or not: gathered through registered staging memory)."""
        if not ranges:
            return [], [], []
        ok = core.parts_registered([[_ptr(p) for p in all_ptrs[i]] for i in range(len(ranges))], [[int(n) for n in all_sizes[i]] for i in range(len(ranges))])
        direct = [i for i, r in enumerate(ranges) if r[0] is not None and ok[i]]
        parts = [i for i, r in enumerate(ranges) if r[0] is None and ok[i]]
        gather = [i for i in range(len(ranges)) if not ok[i]]
        return direct, parts, gather

    def _scratch(self, n: int) -> int:
        """The address of a registered buffer of at least ``n`` bytes, for keys larger than
        half the local buffer (or every gathered key when there is none). Call with
        ``_scratch_lock`` held: one such key moves at a time."""
        if self._scratch_buf is None or len(self._scratch_buf) < n:
            core = self._store()._core
            if self._scratch_buf is not None:
                core.unregister_buffer(self._scratch_addr)
                self._scratch_buf = None
            buf = bytearray(max(n, 1))
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            core.register_buffer(addr, len(buf), buf)  # the core holds buf until unregistered
            self._scratch_buf, self._scratch_addr = buf, addr
        return self._scratch_addr

    def _chunks(self, idx: List[int], totals: List[int]) -> List[List[int]]:
        """Groups keys so that one group's gathered bytes fit in half the local buffer
        (other threads stage through it too); a key larger than that goes alone."""
        cap = max(self._local_buffer_size // 2, 1)
        out: List[List[int]] = []
        cur: List[int] = []
        used = 0
        for i, n in zip(idx, totals):
            if cur and used + n > cap:
                out.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += n
        if cur:
            out.append(cur)
        return out

    # replica placement
    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        """Where ``key``'s replicas live: one ``ReplicaDescriptor`` per complete replica; ``[]``
        when the key is missing or on error (logged), as Mooncake."""
        return self._replica_desc([key]).get(str(key), [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """``{key: [ReplicaDescriptor, ...]}`` for the keys found; missing keys and failures
        are left out (and logged), as Mooncake."""
        return self._replica_desc(keys)

    def _replica_desc(self, keys: Sequence[str]) -> Dict[str, List[ReplicaDescriptor]]:
        names = [str(k) for k in keys]
        try:
            res = self._store()._core.batch_get_replica_desc(names)
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return {}
        out: Dict[str, List[ReplicaDescriptor]] = {}
        for k, (reps, code, msg) in zip(names, res):
            if code != 0 or reps is None:
                if code != OBJECT_NOT_FOUND:
                    _fail(_native.StoreError("batch_get_replica_desc %s: %s" % (k, msg), code))
                else:
                    _log.debug("kvferry store: batch_get_replica_desc: %s not found", k)
                continue
            out[k] = [ReplicaDescriptor(ep, addr, size, local_disk=disk) for ep, addr, size, disk in reps]
        return out

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> List[str]:
        """The keys whose replicas were cleared (Mooncake: [] when nothing was, or on error)."""
        try:
            return self._store().batch_replica_clear([str(k) for k in keys], str(segment_name))
        except Exception:  # noqa: BLE001 - Mooncake answers an empty list on any error
            return []

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_PROVIDED:
            raise AttributeError("MooncakeDistributedStore.%s is not provided by kvferry (%s; docs/PYTHON.md lists every Mooncake name)" % (name, _NOT_PROVIDED[name]))
        raise AttributeError("'MooncakeDistributedStore' object has no attribute %r" % name)

    def get_hostname(self) -> str:
        return self._store().segment_name if self._s is not None else ""

    def close(self) -> int:
        if self._s is None:
            return 0
        try:
            self._s.close()
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        finally:
            self._s = None
            self._scratch_buf = None


def bind_to_numa_node(node: int) -> None:
    """Runs the calling thread on the CPUs of NUMA node ``node`` (as Mooncake's: logs a
    warning and returns None when there is no such node or NUMA is unavailable). Memory
    placement follows first touch (kvferry does not set a preferred node)."""
    try:
        with open("/sys/devices/system/node/node%d/cpulist" % int(node)) as f:
            text = f.read().strip()
        cpus = set()
        for part in text.split(","):
            if "-" in part:
                a, b = part.split("-")
                cpus.update(range(int(a), int(b) + 1))
            elif part:
                cpus.add(int(part))
        if not cpus:
            raise OSError("node %d has no CPUs" % node)
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as e:
        _log.warning("kvferry: bind_to_numa_node(%r) skipped: %s", node, e)


_PARALLELISM = "Mooncake's generalised parallelism tensor calls came after 0.3.14 (kvferry serves 0.3.14's *_tensor_with_tp calls); use put_tensor_with_tp/get_tensor_with_tp"
_NOT_PROVIDED: Dict[str, str] = {
    **{n: _PARALLELISM for n in (
        "get_tensor_with_parallelism", "batch_get_tensor_with_parallelism", "get_tensor_with_parallelism_into",
        "batch_get_tensor_with_parallelism_into", "put_tensor_with_parallelism", "batch_put_tensor_with_parallelism",
        "put_tensor_with_parallelism_from", "batch_put_tensor_with_parallelism_from", "upsert_tensor_with_parallelism",
        "upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism",
    )},
    **{n: "no storage tiers besides memory (segments are mounted by setup())" for n in (
        "init_all", "mount_segment", "unmount_segment", "allocate_and_mount_segment", "unmount_and_free_segment",
        "unmount_local_disk_segment", "get_offload_rpc_read_count",
    )},
    **{n: "no two-phase put/get sessions in kvferry's master protocol" for n in (
        "batch_get_session_start", "batch_get_session_end", "batch_put_session_start", "batch_put_session_end", "batch_put_session_revoke",
        "batch_put_from_multi_buffer_ranges", "batch_get_into_multi_buffer_ranges", "put_from_with_metadata",
    )},
    **{n: "no replica copy/move tasks in kvferry's master" for n in ("create_copy_task", "create_move_task", "query_task")},
}
