"""Several buffers per key: ``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers`` and the staging they share (local buffer, scratch)."""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Sequence, Tuple

from ... import store as _native
from ._common import _cfg, _code, _fail, _ptr, _put_code, _put_fail
from ._types import BUFFER_OVERFLOW, INTERNAL_ERROR, INVALID_PARAMS, ReplicateConfig


class _Multi:
    """Mixed into MooncakeDistributedStore."""

    _s: Any
    _store: Any
    _local_buffer_size: int
    _scratch_lock: Any
    _scratch_buf: Any
    _scratch_addr: int

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
            cfg = _cfg(config, len(keys))
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

