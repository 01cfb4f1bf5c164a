"""kvferry Store from Python: a client of the cluster-wide KV pool (``kvferry master``).

Native API: :class:`Store` raises typed exceptions (a missing key is
:class:`ObjectNotFound`, never empty bytes) and accepts buffer objects (bytearray,
memoryview, numpy arrays, ...) as well as integer addresses for the zero-copy calls::

    from kvferry.store import Store, ReplicateConfig
    with Store(master_server_addr="127.0.0.1:50051", global_segment_size=1 << 30) as s:
        s.put("prefix-1", b"...", ReplicateConfig(replica_num=2))
        data = s.get("prefix-1")
        buf = bytearray(1 << 20)
        s.register_buffer(buf)
        n = s.get_into("prefix-1", buf)

Mooncake's ``MooncakeDistributedStore`` (return codes, empty bytes for a missing key) is in
:mod:`kvferry.mooncake.store`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from ._buffers import as_u64, resolve
from ._engine import _live_engines
from ._errors import KvferryError
from ._kvferry import StoreCore

__all__ = [
    "Store",
    "ReplicateConfig",
    "SoftPinAction",
    "StoreError",
    "StoreInvalidArgument",
    "ObjectNotFound",
    "ObjectAlreadyExists",
    "ObjectHasLease",
    "LeaseExpired",
    "ReplicaNotReady",
    "NoAvailableHandle",
    "StoreTransferError",
    "MasterUnreachable",
]


class StoreError(KvferryError):
    """Base class of store errors; ``.code`` is Mooncake Store's error number."""


class StoreInvalidArgument(StoreError, ValueError):
    """A bad key (empty or over 4096 bytes), parameter, or a buffer too small (-400, -600, -10)."""


class ObjectNotFound(StoreError, KeyError):
    """No such key (-704). Also a ``KeyError``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.reason


class ObjectAlreadyExists(StoreError):
    """``put`` of a key that exists (-705); use ``upsert`` to replace."""


class ObjectHasLease(StoreError):
    """The object is being read (leased); retry later or remove with ``force=True`` (-706)."""


class LeaseExpired(StoreError):
    """The read lease ran out before the read finished; the bytes were discarded (-707)."""


class ReplicaNotReady(StoreError):
    """The object is still being written (-703)."""


class NoAvailableHandle(StoreError):
    """No space for the value: larger than any segment, or every segment full of leased,
    pinned or in-flight objects (-200)."""


class StoreTransferError(StoreError):
    """Moving the bytes failed (-800)."""


class MasterUnreachable(StoreError):
    """The master did not answer (-900)."""


class SoftPinAction(enum.IntEnum):
    """Soft-pin behaviour of a write (Mooncake's ``SoftPinAction``; members are ints)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


@dataclass
class ReplicateConfig:
    """How a value is replicated and kept (Mooncake's ``ReplicateConfig`` fields)."""

    replica_num: int = 1
    with_soft_pin: bool = False
    soft_pin_action: Optional[int] = None
    soft_pin_ttl_ms: Optional[int] = None
    with_hard_pin: bool = False
    preferred_segment: str = ""
    preferred_segments: List[str] = field(default_factory=list)
    group_id: Optional[str] = None

    def _native(self) -> tuple:
        action = self.soft_pin_action
        if action is None:
            action = SoftPinAction.ENABLE if self.with_soft_pin else SoftPinAction.PRESERVE
        prefs = ([self.preferred_segment] if self.preferred_segment else []) + list(self.preferred_segments)
        n = as_u64(self.replica_num, "replica_num")
        ttl = None if self.soft_pin_ttl_ms is None else as_u64(self.soft_pin_ttl_ms, "soft_pin_ttl_ms")
        return (n, int(action), ttl, bool(self.with_hard_pin), prefs, self.group_id)


def _cfg(config: Optional[ReplicateConfig]) -> Optional[tuple]:
    if config is None:
        return None
    if not isinstance(config, ReplicateConfig):
        raise StoreInvalidArgument("config must be a kvferry.store.ReplicateConfig, not %s" % type(config).__name__, -600)
    return config._native()


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise StoreInvalidArgument("keys are str, not %s" % type(key).__name__, -400)
    return key


def _raise_first(results: Sequence[tuple]) -> None:
    """Per-key results come back as (value, code, message); raise for the first failure."""
    for _, code, msg in results:
        if code != 0:
            name, _, text = msg.partition(": ")
            cls = globals().get(name, StoreError)
            raise cls(text or msg, code)


def _engine_core(engine: Any) -> Any:
    """The native engine (``_kvferry.Core``) of ``engine``: a kvferry.Engine, a
    kvferry.mooncake.engine.TransferEngine (initialized), or a Core; None for None."""
    if engine is None:
        return None
    from ._engine import Engine
    from ._kvferry import Core

    if isinstance(engine, Core):
        return engine
    from .mooncake.engine import TransferEngine

    if isinstance(engine, (Engine, TransferEngine)):
        core = engine._core
        if core is None:
            raise StoreInvalidArgument("engine=: the TransferEngine is not initialized; call initialize() first", -600)
        return core
    raise TypeError("engine= takes a kvferry.Engine or kvferry.mooncake.engine.TransferEngine, not %s" % type(engine).__name__)


class Store:
    """A store client: contributes ``global_segment_size`` bytes to the pool and reads and
    writes values with the transfer engine. Thread-safe; blocking calls release the GIL.

    With ``engine`` (a kvferry.Engine or kvferry.mooncake.engine.TransferEngine) no second
    engine starts: the segment is the engine's own (its name, its listeners), and memory
    registered on either serves both. ``local_hostname`` must then be "", the engine's
    segment name or its host. Closing the store leaves the engine running; closing the
    engine first makes every store call raise until the store is closed.

    With ``ssd_offload_path`` (a directory; "" for ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``)
    the client has a disk tier: a master run with ``--enable_offload`` keeps what it evicts
    from this client's segment there, and gets read it back through this client."""

    def __init__(
        self,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        device_name: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        ssd_offload_path: Optional[str] = None,
    ) -> None:
        self._inherited = False
        self._engine = engine
        self._core = StoreCore(
            str(local_hostname),
            str(metadata_server),
            as_u64(global_segment_size, "global_segment_size"),
            as_u64(local_buffer_size, "local_buffer_size"),
            str(protocol),
            str(device_name),
            str(master_server_addr),
            _engine_core(engine),
            None if ssd_offload_path is None else str(ssd_offload_path),
        )
        _live_engines.add(self)  # marked inherited in a fork() child (see kvferry._engine)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def segment_name(self) -> str:
        """This client's transfer-engine segment (what ``preferred_segment`` names)."""
        return self._core.segment_name()

    # -- bytes API ---------------------------------------------------------------------

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> None:
        """Stores ``value`` (bytes-like). Raises ObjectAlreadyExists if the key exists."""
        self._core.put(_key(key), bytes(value), _cfg(config), False)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> None:
        """Stores ``value``, replacing an existing one (readers never see a mix)."""
        self._core.put(_key(key), bytes(value), _cfg(config), True)

    def get(self, key: str) -> bytes:
        """The value of ``key``; raises ObjectNotFound if absent."""
        return self._core.get(_key(key))

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Optional[ReplicateConfig] = None) -> None:
        """Stores several values in one round trip; raises for the first failed key."""
        _raise_first(self._core.put_batch([_key(k) for k in keys], [bytes(v) for v in values], _cfg(config), False))

    def get_batch(self, keys: Sequence[str]) -> List[bytes]:
        """Several values; raises for the first missing or failed key."""
        res = self._core.get_batch([_key(k) for k in keys])
        _raise_first(res)
        return [v for v, _, _ in res]

    # -- zero copy ---------------------------------------------------------------------

    def register_buffer(self, buffer: Any, size: Optional[int] = None) -> int:
        """Registers local memory for put_from/get_into; returns its address."""
        addr, n, keep = resolve(buffer, size, "buffer")
        # The native core holds the pin until unregister_buffer returned or the store closed
        # (even if this object goes first).
        self._core.register_buffer(addr, n, keep)
        return addr

    def unregister_buffer(self, buffer: Any) -> None:
        addr = buffer if isinstance(buffer, int) else resolve(buffer, None, "buffer")[0]
        self._core.unregister_buffer(as_u64(addr, "buffer"))

    def put_from(self, key: str, buffer: Any, size: Optional[int] = None, config: Optional[ReplicateConfig] = None) -> None:
        """Stores ``size`` bytes of registered ``buffer`` without copying through Python."""
        addr, n, _ = resolve(buffer, size, "buffer")
        self._core.put_from(_key(key), addr, n, _cfg(config), False)

    def get_into(self, key: str, buffer: Any, size: Optional[int] = None) -> int:
        """Reads ``key`` into registered ``buffer``; returns the value's size."""
        addr, n, _ = resolve(buffer, size, "buffer")
        return self._core.get_into(_key(key), addr, n)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Optional[Sequence[int]] = None, config: Optional[ReplicateConfig] = None) -> None:
        addrs, lens = self._resolve_many(buffers, sizes)
        _raise_first(self._core.batch_put_from([_key(k) for k in keys], addrs, lens, _cfg(config), False))

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Optional[Sequence[int]] = None) -> List[int]:
        addrs, lens = self._resolve_many(buffers, sizes)
        res = self._core.batch_get_into([_key(k) for k in keys], addrs, lens)
        _raise_first(res)
        return [v for v, _, _ in res]

    @staticmethod
    def _resolve_many(buffers: Sequence[Any], sizes: Optional[Sequence[int]]) -> tuple:
        if sizes is not None and len(sizes) != len(buffers):
            raise StoreInvalidArgument("%d buffers but %d sizes" % (len(buffers), len(sizes)), -600)
        out = [resolve(b, None if sizes is None else sizes[i], "buffers[%d]" % i) for i, b in enumerate(buffers)]
        return [a for a, _, _ in out], [n for _, n, _ in out]

    # -- queries and removal -----------------------------------------------------------

    def is_exist(self, key: str) -> bool:
        return self._core.is_exist(_key(key))

    def batch_is_exist(self, keys: Sequence[str]) -> List[bool]:
        res = self._core.batch_is_exist([_key(k) for k in keys])
        _raise_first(res)
        return [bool(v) for v, _, _ in res]

    def get_size(self, key: str) -> int:
        return self._core.get_size(_key(key))

    def remove(self, key: str, force: bool = False) -> None:
        self._core.remove(_key(key), bool(force))

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._core.remove_by_regex(str(pattern), bool(force))

    def remove_all(self, force: bool = False) -> int:
        return self._core.remove_all(bool(force))

    def batch_replica_clear(self, keys: Sequence[str], segment: str = "") -> List[str]:
        """Clears this client's replicas of `keys`: those on `segment`, or all of them when
        `segment` is empty (Mooncake's rules: only objects this client wrote and nobody
        holds a lease on). Returns the keys cleared."""
        return list(self._core.batch_replica_clear([str(k) for k in keys], str(segment)))

    def close(self) -> None:
        """Unmounts this client's segment (its objects' only replicas there disappear)."""
        self._core.close()
