"""The bytes and zero-copy calls of ``MooncakeDistributedStore``, existence queries and
removals."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ... import store as _native
from ._common import _cfg, _code, _fail, _ptr, _put_code, _put_fail
from ._types import HC_HEALTHY, HC_MASTER_UNREACHABLE, HC_NOT_INITIALIZED, INVALID_KEY, INVALID_PARAMS, BufferHandle, ExistOptions, ReplicateConfig


class _Bytes:
    """Mixed into MooncakeDistributedStore (which provides ``_store()``)."""

    _s: Any
    _store: Any

    # bytes API
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """0 on success, also when the key exists (the stored value is kept, as in Mooncake)."""
        try:
            _cfg(config, 1, True)
            self._store().put(key, value, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _put_fail(e)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        try:
            _cfg(config, 1, True)
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
            res = self._store()._core.put_batch([_native._key(k) for k in keys], [bytes(v) for v in values], _cfg(config, len(keys)), False)
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
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _cfg(config, 1, True), False)
            return 0
        except Exception as e:  # noqa: BLE001
            return _put_fail(e)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _cfg(config, 1, True), True)
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
            res = self._store()._core.batch_put_from([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes], _cfg(config, len(keys)), False)
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
    def is_exist(self, key: str, options: Optional[ExistOptions] = None) -> int:
        """1 present, 0 absent, -1 on error. Grants a read lease, as Mooncake's (a remove
        right after returns -706); :meth:`probe_key` does not. ``options``
        (``ExistOptions``, Mooncake 0.3.14) is checked and has no effect: see ExistOptions."""
        _options("is_exist", options)
        try:
            return 1 if self._store().is_exist(key) else 0
        except Exception as e:  # noqa: BLE001
            return _exist_fail(e)

    def batch_is_exist(self, keys: Sequence[str], options: Optional[ExistOptions] = None) -> List[int]:
        """Per key 1, 0 or -1 (see :meth:`is_exist`)."""
        _options("batch_is_exist", options)
        return self._exists(keys, "batch_is_exist")

    def probe_key(self, key: str) -> int:
        """Mooncake 0.3.14's point-in-time existence check: 1 if ``key`` was readable when the
        master answered, 0 if not, -1 on error. Unlike :meth:`is_exist` it grants no read
        lease and leaves the key's place in the eviction order alone (a request of its own,
        ``ProbeKey``, to the master): the object may be removed or evicted before a later
        get."""
        try:
            return 1 if self._store()._core.probe_key(str(key)) else 0
        except Exception as e:  # noqa: BLE001
            return _exist_fail(e)

    def batch_probe_key(self, keys: Sequence[str], policy: str = "none", candidate_size: int = 1) -> List[int]:
        """:meth:`probe_key` for several keys in one round trip: per key 1, 0, or a negative
        error number. ``policy`` is ``"none"`` (no lease) or ``"LastHitOnly"``: the keys are
        taken in groups of ``candidate_size`` and the last group whose keys were all found is
        then leased (as :meth:`batch_is_exist` leases), a second request; a group key gone by
        then (removed or evicted in between) reads 0 and keeps whatever leases the others got,
        as in Mooncake. Another policy raises ValueError; with ``"LastHitOnly"``, a
        ``candidate_size`` of 0 or one that does not divide the number of keys gives -600 for
        every key."""
        if policy not in ("none", "LastHitOnly"):
            raise ValueError("Unknown batch_probe_key policy: %s" % policy)
        if isinstance(candidate_size, bool) or not isinstance(candidate_size, int) or candidate_size < 0:
            raise TypeError("batch_probe_key(): candidate_size must be a non-negative int, not %r" % (candidate_size,))
        if policy == "LastHitOnly" and keys and (candidate_size == 0 or len(keys) % candidate_size):
            _fail(_native.StoreInvalidArgument(
                "batch_probe_key: %d keys do not split into groups of candidate_size=%d" % (len(keys), candidate_size), INVALID_PARAMS))
            return [INVALID_PARAMS] * len(keys)
        out = self._exists(keys, "batch_probe_key")
        if policy == "LastHitOnly" and keys:
            hits = [g for g in range(0, len(keys), candidate_size) if all(r == 1 for r in out[g:g + candidate_size])]
            if hits:
                g = hits[-1]
                for i, r in zip(range(g, g + candidate_size), self._exists(keys[g:g + candidate_size], "batch_is_exist")):
                    if r != 1:
                        out[i] = r
        return out

    def _exists(self, keys: Sequence[str], call: str) -> List[int]:
        try:
            names = [str(k) for k in keys]
            core = self._store()._core
            res = core.batch_probe_key(names) if call == "batch_probe_key" else core.batch_is_exist(names)
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [-1] * len(keys)
        return [(1 if v else 0) if code == 0 else (0 if code == INVALID_KEY else -1) for v, code, _ in res]

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
            _native._raise_first(self._store()._core.put_batch([str(k) for k in keys], [bytes(v) for v in values], _cfg(config, len(keys)), True))
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
            self._store()._core.put(str(key), value, _cfg(config, 1, True), upsert)
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
            res = self._store()._core.batch_put_from([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes], _cfg(config, len(keys)), True)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [0 if code == 0 else code for _, code, _ in res]



def _options(call: str, options: Any) -> None:
    if options is not None and not isinstance(options, ExistOptions):
        raise TypeError("%s(): options must be an ExistOptions, not %s" % (call, type(options).__name__))


def _exist_fail(e: BaseException) -> int:
    """An existence check's answer on error: 0 for an invalid key (the empty key: Mooncake
    answers that it does not exist), else -1 (logged)."""
    if _code(e) == INVALID_KEY:
        return 0
    _fail(e)
    return -1
