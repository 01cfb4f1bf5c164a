"""Byte ranges of objects: ``get_into_ranges``, and Mooncake 0.3.14's ranged reads from a
snapshot of replica lists (``prepare_get_into_ranges_snapshot``,
``get_into_ranges_from_snapshot``)."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Sequence

from ... import _kvferry
from ... import store as _native
from ._common import _code, _fail, _ptr
from ._types import INTERNAL_ERROR, INVALID_PARAMS, OBJECT_NOT_FOUND


class RangedReadSnapshot:
    """Mooncake 0.3.14's reusable snapshot of replica lists for ranged reads, made by
    ``prepare_get_into_ranges_snapshot``: each key found was asked for once (a read lease,
    so its replicas are neither freed nor reused while the snapshot lives) and
    ``get_into_ranges_from_snapshot`` reads ranges straight from those replicas, asking
    again for the lists whose lease is half spent. Dropping the snapshot releases them."""

    __slots__ = ("_owner", "_native", "_sizes", "_codes")

    def __init__(self) -> None:
        raise TypeError("RangedReadSnapshot objects are made by MooncakeDistributedStore.prepare_get_into_ranges_snapshot()")

    def __del__(self) -> None:
        n = getattr(self, "_native", None)
        if n is not None:
            try:
                n.get_end()
            except Exception:  # noqa: BLE001 - the store may be closed already
                pass


class _Ranges:
    """Mixed into MooncakeDistributedStore."""

    _store: Any

    def prepare_get_into_ranges_snapshot(self, keys: Sequence[str]) -> RangedReadSnapshot:
        """A :class:`RangedReadSnapshot` of ``keys``' replica lists (one round trip to the
        master). A key missing now reads -704 from it; a key not named here, -600."""
        snap = object.__new__(RangedReadSnapshot)
        snap._owner, snap._native, snap._sizes, snap._codes = self, None, {}, {}
        names = [str(k) for k in keys]
        try:
            snap._native = _kvferry.StoreSessions(self._store()._core)
            res = snap._native.get_start(names)
        except Exception as e:  # noqa: BLE001
            code = _fail(e)
            snap._codes = {k: code for k in names}
            return snap
        for k, (size, code, msg) in zip(names, res):
            if code == 0:
                snap._sizes[k] = int(size)
            else:
                if code != OBJECT_NOT_FOUND:
                    _fail(_native.StoreError("prepare_get_into_ranges_snapshot %s: %s" % (k, msg), code))
                snap._codes[k] = code
        return snap

    def get_into_ranges_from_snapshot(
        self,
        snapshot: RangedReadSnapshot,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[str]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> List[List[List[int]]]:
        """:meth:`get_into_ranges` from a snapshot: each range is read straight from the
        snapshot's replica into ``buffer_ptrs[i] + dst`` (registered memory: a range outside
        it gives -600), all of a call's ranges in one transfer batch. Per range: the bytes
        read; -600 for a key not in the snapshot, a range past the value's end, a null or
        unregistered buffer, or lists that do not match; -704 for a key missing when the
        snapshot was made or gone when its list was asked for again. A snapshot of another
        store raises ValueError."""
        if not isinstance(snapshot, RangedReadSnapshot) or snapshot._owner is not self:
            raise ValueError("Ranged-read snapshot belongs to another Store")
        n = len(buffer_ptrs)
        out = _filled(n, all_keys, all_dst_offsets, INVALID_PARAMS)
        if not n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            _fail(_native.StoreInvalidArgument("get_into_ranges_from_snapshot: %d buffers, %d key lists, %d/%d/%d offset and size lists: one of each per buffer"
                                               % (n, len(all_keys), len(all_dst_offsets), len(all_src_offsets), len(all_sizes)), INVALID_PARAMS))
            return out
        try:
            core = self._store()._core
        except Exception as e:  # noqa: BLE001
            return _filled(n, all_keys, all_dst_offsets, _fail(e))
        # One native item per (buffer, key): its ranges (local address, length, value offset).
        items: List[Any] = []
        for i in range(n):
            keys_i, dst_i, src_i, len_i = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            try:
                ptr = _ptr(buffer_ptrs[i])
            except Exception as e:  # noqa: BLE001
                _fail(e)
                continue
            if ptr == 0 or not len(keys_i) == len(dst_i) == len(src_i) == len(len_i):
                continue
            for j, k in enumerate(keys_i):
                k = str(k)
                if not len(dst_i[j]) == len(src_i[j]) == len(len_i[j]):
                    continue
                if k not in snapshot._sizes:
                    code = snapshot._codes.get(k, INVALID_PARAMS)
                    out[i][j] = [code] * len(dst_i[j])
                    continue
                size = snapshot._sizes[k]
                ranges = []
                for r, (d, o, m) in enumerate(zip(dst_i[j], src_i[j], len_i[j])):
                    d, o, m = int(d), int(o), int(m)
                    if d < 0 or o < 0 or m < 0 or o + m > size:
                        _fail(_native.StoreInvalidArgument("get_into_ranges_from_snapshot: %s: range [%d, %d) is past the value's %d bytes" % (k, o, o + m, size), INVALID_PARAMS))
                        continue
                    ranges.append((r, (ptr + d, m, o)))
                if ranges:
                    items.append((i, j, k, ranges))
        if not items:
            return out
        try:
            ok = core.parts_registered([[a for _, (a, _m, _o) in rs] for _, _, _, rs in items], [[m for _, (_a, m, _o) in rs] for _, _, _, rs in items])
            for it in [it for it, good in zip(items, ok) if not good]:
                _fail(_native.StoreInvalidArgument("get_into_ranges_from_snapshot: %s: a destination range is outside registered memory (register_buffer it)" % it[2], INVALID_PARAMS))
            items = [it for it, good in zip(items, ok) if good]
            res = snapshot._native.get_read([k for _, _, k, _ in items], [[g for _, g in rs] for _, _, _, rs in items])
        except Exception as e:  # noqa: BLE001
            code = _fail(e)
            for i, j, _, rs in items:
                for r, _ in rs:
                    out[i][j][r] = code
            return out
        for (i, j, k, rs), (_, code, msg) in zip(items, res):
            if code != 0 and code != OBJECT_NOT_FOUND:
                _fail(_native.StoreError("get_into_ranges_from_snapshot %s: %s" % (k, msg), code))
            for r, (_, m, _) in rs:
                out[i][j][r] = m if code == 0 else (INVALID_PARAMS if code == INVALID_PARAMS else code)
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



def _filled(n: int, all_keys: Sequence[Sequence[str]], all_dst_offsets: Sequence[Sequence[Sequence[int]]], code: int) -> List[List[List[int]]]:
    """The result's shape (per buffer, key and range), every range set to ``code``."""
    out = []
    for i in range(n):
        keys_i = all_keys[i] if i < len(all_keys) else []
        dst_i = all_dst_offsets[i] if i < len(all_dst_offsets) else []
        out.append([[code] * (len(dst_i[j]) if j < len(dst_i) else 0) for j in range(len(keys_i))])
    return out
