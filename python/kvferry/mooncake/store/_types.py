"""The value types of Mooncake's ``mooncake.store``: error numbers, enums, replica
descriptors, ``ReplicateConfig``, ``BufferHandle``."""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import errno
import mmap
import numbers
import operator
import os
import threading
from typing import Any, Dict, List, Optional

from ... import store as _native

SoftPinAction = _native.SoftPinAction

INVALID_PARAMS = -600
INVALID_KEY = -400
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


# ReplicateConfig's list-of-str fields (nesting depth) that Mooncake's setters type-check.
_STR_LISTS = {"preferred_hca_names": 1, "per_key_preferred_hca_names": 2, "residency_affinity_ids": 1, "session_ids": 1, "group_ids": 1}


def _str_list(name: str, v: Any, depth: int) -> list:
    ok = isinstance(v, (list, tuple)) and all(
        isinstance(x, str) if depth == 1 else isinstance(x, (list, tuple)) and all(isinstance(y, str) for y in x) for x in v
    )
    if not ok:
        raise TypeError("ReplicateConfig.%s must be None or a list of %s, not %r" % (name, "str" if depth == 1 else "lists of str", v))
    return [x if depth == 1 else list(x) for x in v]


@dataclasses.dataclass
class ReplicateConfig(_native.ReplicateConfig):
    """Mooncake's ReplicateConfig: same fields and defaults (``soft_pin_action`` is
    ``SoftPinAction.PRESERVE``, ``group_ids`` None), and the same checks: ``soft_pin_ttl_ms``
    outside [0, 2**64) or a ``soft_pin_action`` that is not a SoftPinAction raises TypeError
    when set; a TTL with an action other than ENABLE makes the write return -600.

    ``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``,
    ``prefer_alloc_in_same_node`` and ``data_type`` are accepted and have no effect (kvferry
    has no NVMe-oF/DFS tiers). ``with_soft_pin=True`` (older Mooncake) means ENABLE.

    Mooncake 0.3.14's fields, None by default, lists of str when set (TypeError otherwise):
    ``preferred_hca_names`` and ``per_key_preferred_hca_names`` (the RDMA NICs a write should
    use), ``residency_affinity_ids`` and ``session_ids`` are accepted and checked as Mooncake
    checks them -- the per-key lists (``group_ids`` too) must have one entry per key of the
    call, one for a single-key put (``per_key_preferred_hca_names`` is not checked there),
    else the write returns -600 -- and have no other effect: kvferry's store moves a write's
    bytes over the NICs its engine was set up with, and has no weight residency or put
    sessions keyed by id."""

    soft_pin_action: Any = SoftPinAction.PRESERVE
    nof_replica_num: int = 0
    dfs_replica_num: int = 0
    preferred_nof_segments: List[str] = dataclasses.field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    data_type: Any = ObjectDataType.UNKNOWN
    group_ids: Optional[List[str]] = None
    preferred_hca_names: Optional[List[str]] = None
    per_key_preferred_hca_names: Optional[List[List[str]]] = None
    residency_affinity_ids: Optional[List[str]] = None
    session_ids: Optional[List[str]] = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _STR_LISTS and value is not None:
            value = _str_list(name, value, _STR_LISTS[name])
        elif name == "soft_pin_ttl_ms":
            value = _u64_or_none(name, value)
        elif name in ("replica_num", "nof_replica_num", "dfs_replica_num"):
            if _u64_or_none(name, value) is None:
                raise TypeError("ReplicateConfig.%s must be an integer in [0, 2**64), not None" % name)
        elif name == "soft_pin_action":
            if isinstance(value, bool) or not isinstance(value, int) or value not in tuple(SoftPinAction):
                raise TypeError("ReplicateConfig.soft_pin_action must be a SoftPinAction (PRESERVE, ENABLE, DISABLE), not %r" % (value,))
            value = SoftPinAction(value)
        super().__setattr__(name, value)

    def _check_keys(self, n: int, single: bool) -> None:
        """Mooncake's check of the per-key lists against a call's ``n`` keys (``single``: a
        one-key put, where ``per_key_preferred_hca_names`` is not looked at)."""
        names = ["group_ids", "residency_affinity_ids", "session_ids"] + ([] if single else ["per_key_preferred_hca_names"])
        for name in names:
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise _native.StoreInvalidArgument(
                    "ReplicateConfig.%s has %d entries for %d key%s: one per key (or None)" % (name, len(v), n, "" if n == 1 else "s"), INVALID_PARAMS
                )

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



class ExistOptions:
    """Mooncake 0.3.14's ``ExistOptions`` for ``is_exist``/``batch_is_exist``:
    ``prefetch_to_memory`` (bool, default False) asks Mooncake to promote SSD-only keys to
    memory. kvferry accepts it and promotes nothing: a get of a key held only on a disk reads
    it from there."""

    __slots__ = ("_prefetch",)

    def __init__(self) -> None:
        self._prefetch = False

    @property
    def prefetch_to_memory(self) -> bool:
        return self._prefetch

    @prefetch_to_memory.setter
    def prefetch_to_memory(self, v: bool) -> None:
        # As Mooncake's (pybind11's bool): None is False, numbers convert, anything else
        # (a str, a list) raises TypeError.
        if v is not None and not isinstance(v, numbers.Number):
            raise TypeError("ExistOptions.prefetch_to_memory must be a bool, not %r" % (v,))
        self._prefetch = bool(v)

    def __repr__(self) -> str:
        return "<ExistOptions prefetch_to_memory=%s>" % self._prefetch


class MooncakeHostMemAllocator:
    """Mooncake's host-memory allocator (``alloc(size)`` -> address, ``free(address)`` -> 0,
    or -1 for an address it did not hand out or freed already). Like Mooncake's (shared
    memory through one process-wide helper), each block is its own page-aligned shared
    mapping of a memfd, zero-filled; any instance frees any block. ``alloc`` of 0 bytes (or a
    size the kernel refuses) raises RuntimeError, as Mooncake's. To use a block with the
    store, ``register_buffer`` it."""

    _blocks: Dict[int, Any] = {}
    _lock = threading.Lock()

    def alloc(self, size: int) -> int:
        n = operator.index(size)
        try:
            if n <= 0:
                raise OSError(errno.EINVAL, "Invalid argument")
            fd = os.memfd_create("kvferry-host-mem", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, n)
                mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            raise RuntimeError("Failed to map shared memory: %s" % (e.strerror or e)) from None
        anchor = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(anchor)
        with self._lock:
            self._blocks[addr] = (mm, anchor)
        return addr

    def free(self, ptr: int) -> int:
        with self._lock:
            block = self._blocks.pop(operator.index(ptr), None)
        if block is None:
            return -1
        mm, anchor = block
        del anchor, block  # the mapping's last export: it can close now
        mm.close()
        return 0
