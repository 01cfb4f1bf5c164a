"""Mooncake 0.3.14's two-phase sessions for layer-wise transfers: a put session reserves
space for its keys at the master, ``batch_put_from_multi_buffer_ranges`` writes them range
by range (straight into every replica, no copy) and ``batch_put_session_end`` makes them
readable (or ``..._revoke`` frees the space); a get session asks for the keys' replica lists
once and ``batch_get_into_multi_buffer_ranges`` reads ranges of them. Also
``put_from_with_metadata``, and segments mounted after setup (``allocate_and_mount_segment``,
``unmount_and_free_segment``)."""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ... import _kvferry
from ... import store as _native
from ._common import _cfg, _fail, _ptr
from ._types import INVALID_PARAMS, OBJECT_NOT_FOUND, ReplicateConfig


class _Sessions:
    """Mixed into MooncakeDistributedStore (which provides ``_store()`` and
    ``batch_put_from_multi_buffers``)."""

    _store: Any
    _sessions: Any
    _protocol: str
    batch_put_from_multi_buffers: Any

    def _session(self) -> Any:
        if self._sessions is None:
            self._sessions = _kvferry.StoreSessions(self._store()._core)
        return self._sessions

    def _codes(self, keys: Sequence[str], call: str, f: Any) -> List[int]:
        """Per key 0 or the error number of ``f(session)``'s per-key answers (logged, but a
        missing key is not)."""
        try:
            res = f(self._session())
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        out = []
        for k, (_, code, msg) in zip(keys, res):
            if code not in (0, OBJECT_NOT_FOUND):
                _fail(_native.StoreError("%s %s: %s" % (call, k, msg), code))
            out.append(code)
        return out

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int], config: Optional[ReplicateConfig] = None) -> List[int]:
        """Reserves ``sizes[i]`` bytes for ``keys[i]`` on ``config.replica_num`` segments
        without writing (one round trip): per key 0, -705 (it exists, or is reserved in this
        store's session already), -200 (no space) or -600 (a size of 0, ``sizes`` not one per
        key, or ``config``'s per-key lists not one per key). The keys are not readable until
        :meth:`batch_put_session_end`; a reservation neither ended nor revoked is discarded by
        the master after its ``put_start_discard_timeout`` (30 s)."""
        names = [str(k) for k in keys]
        try:
            if len(sizes) != len(names):
                raise _native.StoreInvalidArgument("batch_put_session_start: %d keys, %d sizes" % (len(names), len(sizes)), INVALID_PARAMS)
            ns = [int(n) for n in sizes]
            if any(n <= 0 for n in ns):
                raise _native.StoreInvalidArgument("batch_put_session_start: every size must be positive", INVALID_PARAMS)
            cfg = _cfg(config, len(names))
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(names)
        return self._codes(names, "batch_put_session_start", lambda s: s.put_start(names, ns, cfg))

    def batch_put_from_multi_buffer_ranges(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], all_dst_offsets: Sequence[Sequence[int]]
    ) -> List[int]:
        """Writes, per key of an open put session, each buffer ``all_buffer_ptrs[i][j]`` of
        ``all_sizes[i][j]`` bytes (registered memory) at offset ``all_dst_offsets[i][j]`` of
        the value, straight into every replica; all keys in one transfer batch. Per key the
        bytes written, or -600 (not in a put session, a range past the reserved size, lists
        that do not match, a buffer outside registered memory)."""
        return self._ranged("batch_put_from_multi_buffer_ranges", keys, all_buffer_ptrs, all_sizes, all_dst_offsets, put=True)

    def batch_put_session_end(self, keys: Sequence[str]) -> List[int]:
        """Ends the put sessions of ``keys``: readable from now. Per key 0, or -600 for a key
        not in an open put session."""
        names = [str(k) for k in keys]
        return self._codes(names, "batch_put_session_end", lambda s: s.put_finish(names, False))

    def batch_put_session_revoke(self, keys: Sequence[str]) -> List[int]:
        """Revokes the put sessions of ``keys``: their space is freed, nothing is stored. Per
        key 0, or -600 for a key not in an open put session."""
        names = [str(k) for k in keys]
        return self._codes(names, "batch_put_session_revoke", lambda s: s.put_finish(names, True))

    def batch_get_session_start(self, keys: Sequence[str]) -> List[int]:
        """Asks for the replica lists of ``keys`` once and keeps them for
        :meth:`batch_get_into_multi_buffer_ranges` (each a read lease: a remove returns -706
        meanwhile; lists whose lease is half spent are asked for again before a read). Per
        key 0 or -704."""
        names = [str(k) for k in keys]
        return self._codes(names, "batch_get_session_start", lambda s: s.get_start(names))

    def batch_get_into_multi_buffer_ranges(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], all_src_offsets: Sequence[Sequence[int]]
    ) -> List[int]:
        """Reads, per key of an open get session, ``all_sizes[i][j]`` bytes from offset
        ``all_src_offsets[i][j]`` of the value into ``all_buffer_ptrs[i][j]`` (registered
        memory), straight from the kept replica; all keys in one transfer batch. Per key the
        bytes read, or -600 (not in a get session, a range past the value's end, lists that do
        not match, a buffer outside registered memory)."""
        return self._ranged("batch_get_into_multi_buffer_ranges", keys, all_buffer_ptrs, all_sizes, all_src_offsets, put=False)

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Releases the kept replica lists of ``keys`` (keys not kept are ignored); 0."""
        try:
            if self._sessions is not None:
                self._sessions.get_end([str(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            _fail(e)
        return 0

    def _ranged(self, call: str, keys: Sequence[str], all_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]], all_offs: Sequence[Sequence[int]], put: bool) -> List[int]:
        names = [str(k) for k in keys]
        if not len(names) == len(all_ptrs) == len(all_sizes) == len(all_offs):
            _fail(_native.StoreInvalidArgument("%s: %d keys, %d buffer lists, %d size lists, %d offset lists: one of each per key" % (call, len(names), len(all_ptrs), len(all_sizes), len(all_offs)), INVALID_PARAMS))
            return [INVALID_PARAMS] * len(names)
        out = [INVALID_PARAMS] * len(names)
        items: List[Tuple[int, List[Tuple[int, int, int]]]] = []
        for i, (k, ptrs, sizes, offs) in enumerate(zip(names, all_ptrs, all_sizes, all_offs)):
            try:
                if not len(ptrs) == len(sizes) == len(offs) or not ptrs:
                    raise _native.StoreInvalidArgument("%s: %s: %d buffers, %d sizes, %d offsets (at least one, one of each per buffer)" % (call, k, len(ptrs), len(sizes), len(offs)), INVALID_PARAMS)
                rs = [(_ptr(p), int(n), int(o)) for p, n, o in zip(ptrs, sizes, offs)]
                if any(p == 0 or n < 0 or o < 0 for p, n, o in rs):
                    raise _native.StoreInvalidArgument("%s: %s: a null buffer or a negative size or offset" % (call, k), INVALID_PARAMS)
            except Exception as e:  # noqa: BLE001
                _fail(e)
                continue
            items.append((i, rs))
        if not items:
            return out
        try:
            core = self._store()._core
            ok = core.parts_registered([[p for p, _, _ in rs] for _, rs in items], [[n for _, n, _ in rs] for _, rs in items])
            for (i, _), good in zip(items, ok):
                if not good:
                    _fail(_native.StoreInvalidArgument("%s: %s: a buffer is outside registered memory (register_buffer it)" % (call, names[i]), INVALID_PARAMS))
            items = [it for it, good in zip(items, ok) if good]
            s = self._session()
            res = (s.put_write if put else s.get_read)([names[i] for i, _ in items], [rs for _, rs in items])
        except Exception as e:  # noqa: BLE001
            code = _fail(e)
            for i, _ in items:
                out[i] = code
            return out
        for (i, _), (n, code, msg) in zip(items, res):
            if code == 0:
                out[i] = int(n)
            else:
                _fail(_native.StoreError("%s %s: %s" % (call, names[i], msg), code))
                # (As Mooncake: a ranged call's failures are -600, whatever their cause.)
                out[i] = INVALID_PARAMS
        return out

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int, size: int, metadata_size: int, config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes
        at ``buffer_ptr`` as ``key`` (Mooncake's layout: the metadata first); 0 or a negative
        error number (as ``put_from``: an existing key is kept and 0 returned). Written as
        :meth:`batch_put_from_multi_buffers` writes one key of two buffers: straight from
        registered memory, else gathered through the local buffer."""
        ptrs, sizes = [buffer_ptr], [size]
        if int(metadata_size) > 0:
            ptrs, sizes = [metadata_buffer_ptr, buffer_ptr], [metadata_size, size]
        return int(self.batch_put_from_multi_buffers([key], [ptrs], [sizes], config)[0])

    # segments mounted after setup
    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> Dict[str, Any]:
        """Mounts ``size`` more bytes of this process's memory (allocated and registered
        here, page-aligned, zero-filled) as a segment of its own, served by the store's
        engine: ``{"ret": 0, "segment_ids": [id], "allocated_size": n}``, or ``ret`` -1
        (logged) for a size of 0, memory that cannot be had, a ``location`` that is not host
        memory (``""``, ``"cpu"``, ``"cpu:N"``) or a ``protocol`` other than the store's
        (each segment is served by the store's one engine). The segment is remounted with the
        setup's one after a failover or a master restart; close() unmounts it."""
        out: Dict[str, Any] = {"ret": -1, "segment_ids": [], "allocated_size": 0}
        try:
            n = operator.index(size)
            loc = str(location)
            if loc and loc != "cpu" and not loc.startswith("cpu:"):
                raise _native.StoreInvalidArgument("allocate_and_mount_segment: location %r: kvferry mounts host memory only" % loc, INVALID_PARAMS)
            proto = str(protocol)
            if proto and proto != self._protocol:
                raise _native.StoreInvalidArgument("allocate_and_mount_segment: protocol %r: this store's engine serves %r" % (proto, self._protocol), INVALID_PARAMS)
            sid, got = self._session().mount_more(n)
        except Exception as e:  # noqa: BLE001 - Mooncake answers ret -1
            _fail(e)
            return out
        out.update(ret=0, segment_ids=[str(sid)], allocated_size=int(got))
        return out

    def unmount_and_free_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        """Unmounts segments ``allocate_and_mount_segment`` mounted: their objects' replicas
        there are dropped at once; their memory is freed once ``grace_period_seconds`` and the
        longest a transfer may still touch it (twice the transfer timeout) have passed. 0, or
        -1 (logged) if one of the ids is not such a segment of this store (the others are
        unmounted)."""
        ret = 0
        grace = operator.index(grace_period_seconds)
        for sid in segment_ids:
            try:
                n = int(str(sid))
            except ValueError:
                _fail(_native.StoreInvalidArgument("unmount_and_free_segment: %r is not a segment id of this store" % (sid,), INVALID_PARAMS))
                ret = -1
                continue
            try:
                self._session().unmount_more(n, max(grace, 0))
            except Exception as e:  # noqa: BLE001
                _fail(e)
                ret = -1
        return ret
