"""Mooncake's ``mooncake.store`` API on kvferry: ``MooncakeDistributedStore``,
``ReplicateConfig``, ``SoftPinAction``, with Mooncake's return conventions (0 or a negative
error number; ``get`` of a missing key returns ``b""``; ``is_exist`` 1/0/-1).

The master is ``kvferry master`` (its own protocol, not ``mooncake_master``'s). Mooncake
0.3.13 names that kvferry does not provide raise AttributeError / NotImplementedError naming
kvferry; docs/PYTHON.md has the name-by-name table."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Sequence

from ... import store as _native
from ..buffer_pool import BufferLease, BufferPool, RegisteredBufferLease, RegisteredBufferPool
from ._bytes import _Bytes
from ._common import _fail, _log, _logged, _parse_bool, _parse_size  # noqa: F401 - tests use _parse_size
from ._missing import _MODULE_NOT_PROVIDED, _NOT_PROVIDED
from ._multi import _Multi
from ._ranges import RangedReadSnapshot, _Ranges
from ._sessions import _Sessions
from ._tasks import QueryTaskResponse, TaskStatus, TaskType, _Tasks
from ._setup import _Setup
from .._tensor import TensorMethods, deserialize_tensor as _deserialize_tensor, serialize_tensor as _serialize_tensor, tensor_metadata_size as _tensor_metadata_size  # noqa: F401 - Mooncake's private exports
from ._types import (  # noqa: F401 - the module's names, as before the split
    BUFFER_OVERFLOW,
    HC_HEALTHY,
    HC_MASTER_UNREACHABLE,
    HC_NOT_INITIALIZED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    BufferHandle,
    Descriptor,
    ExistOptions,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)

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
    "ExistOptions",
    "RangedReadSnapshot",
    "MooncakeHostMemAllocator",
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "RegisteredBufferLease",
    "bind_to_numa_node",
    "TaskType",
    "TaskStatus",
    "QueryTaskResponse",
]


# Mooncake exports these enums' values at module level too (export_values()).
globals().update({m.name: m for m in ObjectDataType})
globals().update({m.name: m for m in ReplicaStatus})
# (Last, as in Mooncake's module: its PROCESSING and FAILED are TaskStatus's.)
globals().update({m.name: m for m in TaskType})
globals().update({m.name: m for m in TaskStatus})
__all__ += sorted({m.name for e in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus) for m in e})


class MooncakeDistributedStore(_Setup, _Bytes, _Multi, _Ranges, _Sessions, _Tasks, TensorMethods):
    """Mooncake Store's Python client API."""

    def __init__(self) -> None:
        self._s: Optional[_native.Store] = None
        self._local_buffer_size = 0
        self._protocol = "tcp"
        # A registered buffer for gathered keys the local buffer cannot stage (see _scratch).
        self._scratch_lock = threading.Lock()
        self._scratch_buf: Optional[bytearray] = None
        self._scratch_addr = 0
        self._embedded: Any = None  # setup(enable_embedded_master=True)'s master
        self._sessions: Any = None  # put/get sessions (made at the first session call)

    def _store(self) -> _native.Store:
        if self._s is None:
            raise _native.StoreError("setup() has not succeeded", INTERNAL_ERROR)
        return self._s

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
            self._sessions = None
            if self._embedded is not None:
                self._embedded.shutdown()
                self._embedded = None


def __getattr__(name: str) -> Any:
    if name in _MODULE_NOT_PROVIDED:
        raise AttributeError("mooncake.store.%s is not provided by kvferry (%s; docs/PYTHON.md lists every Mooncake name)" % (name, _MODULE_NOT_PROVIDED[name]))
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


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
