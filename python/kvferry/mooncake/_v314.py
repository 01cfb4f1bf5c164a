"""Mooncake 0.3.14's new ``TransferEngine`` calls on kvferry: descriptor arrays through the
buffer protocol, page tables expanded in the engine, scatter transfers with tickets. Mixed
into :class:`kvferry.mooncake.engine.TransferEngine`."""

from __future__ import annotations

import enum
import operator
from typing import Any, Optional, Sequence, Tuple

from .. import _kvferry
from .._errors import InvalidArgument, KvferryError
from ._args import _NOT_INITIALIZED, _SIG, _Bad, _array, _fail, _incompatible, _s, _seq, _u, _ul, log


class ScatterTransferCompletionStatus(enum.IntEnum):
    """How a scatter operation ended: ``COMPLETED``; ``FAILED_DRAINED`` (a fragment failed,
    and every fragment has ended: nothing of it lands any more); ``COMPLETION_UNKNOWN`` (not
    known yet: fragments may still be moving)."""

    COMPLETED = 0
    FAILED_DRAINED = -1
    COMPLETION_UNKNOWN = -2

    def __str__(self) -> str:
        return "ScatterTransferCompletionStatus.%s" % self.name


class ScatterTransferTicket:
    """Keeps a scatter operation alive until native DMA is drained: its local ranges may be
    written (READ) or read (WRITE) until :attr:`drained`. Dropping the ticket early does not
    cut the operation short: the engine keeps it until every fragment ended."""

    __slots__ = ("_core", "_bid", "_status", "_reason", "__weakref__")

    def __init__(self) -> None:
        raise TypeError("ScatterTransferTicket objects are returned by submit_scatter_*() and scatter_transfer_sync_*_with_ticket()")

    @classmethod
    def _of(cls, core: Any, bid: int) -> "ScatterTransferTicket":
        t = object.__new__(cls)
        t._core, t._bid, t._status, t._reason = core, bid, ScatterTransferCompletionStatus.COMPLETION_UNKNOWN, None
        return t

    @classmethod
    def _failed(cls, reason: str) -> "ScatterTransferTicket":
        # Nothing was submitted: drained at once.
        t = cls._of(None, 0)
        t._status, t._reason = ScatterTransferCompletionStatus.FAILED_DRAINED, reason
        return t

    def _settle(self, st: int, reason: Optional[str]) -> None:
        self._status = ScatterTransferCompletionStatus.COMPLETED if st == 4 else ScatterTransferCompletionStatus.FAILED_DRAINED
        self._reason = reason
        core, self._core = self._core, None
        try:
            core.release_batch(self._bid)
        except KvferryError:
            pass
        if st != 4:
            log.warning("scatter transfer failed: %s", reason or "status %d" % st)

    def _wait(self, timeout: Optional[float]) -> ScatterTransferCompletionStatus:
        core = self._core
        if core is None:
            return self._status
        try:
            st, _, reason, _ = core.wait_batch(self._bid, timeout)
        except KvferryError as e:  # the engine was closed: its batches ended with it
            self._core = None
            self._status, self._reason = ScatterTransferCompletionStatus.FAILED_DRAINED, e.reason
            return self._status
        if st in (0, 1):
            return ScatterTransferCompletionStatus.COMPLETION_UNKNOWN
        self._settle(st, reason)
        return self._status

    @property
    def status(self) -> ScatterTransferCompletionStatus:
        """COMPLETED or FAILED_DRAINED once every fragment ended, else COMPLETION_UNKNOWN
        (does not wait)."""
        return self._wait(0.0)

    @property
    def drained(self) -> bool:
        """Whether every fragment has ended (nothing of the operation touches memory any
        more)."""
        return self._wait(0.0) != ScatterTransferCompletionStatus.COMPLETION_UNKNOWN

    def drain(self, timeout_ms: int) -> ScatterTransferCompletionStatus:
        """Waits up to ``timeout_ms`` milliseconds (negative: no limit) for every fragment to
        end; returns :attr:`status` (COMPLETION_UNKNOWN if still moving at the timeout)."""
        try:
            ms = operator.index(timeout_ms)
        except TypeError:
            raise TypeError("drain(): timeout_ms must be an int, not %s" % type(timeout_ms).__name__) from None
        return self._wait(None if ms < 0 else ms / 1000.0)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            try:
                core.release_batch(self._bid)  # freed by the engine once every fragment ended
            except Exception:
                pass

    def __repr__(self) -> str:
        return "<ScatterTransferTicket %s>" % self._status.name


class _Calls314:
    """The 0.3.14 calls; the class they are mixed into provides ``_need`` and ``_hints``."""

    _need: Any
    _hints: Any


    def _arrays_call(self, method: str, args: Tuple[Any, ...], op: int, submit: bool) -> int:
        fail = 0 if submit else -1
        try:
            t, th, nh = _s(args[0]), _s(args[4]), _s(args[5])
        except _Bad:
            raise _incompatible(method, _SIG[method], args) from None
        arrays = [_array(a, name, method, args) for a, name in zip(args[1:4], ("buffers", "peer_buffer_addresses", "lengths"))]
        core = self._need(method)
        if core is None:
            return fail
        if not self._hints(method, core, t, (th, nh)):
            return fail
        raw = tuple(a[0] for a in arrays)
        signed = tuple(a[1] for a in arrays)
        try:
            if submit:
                return _kvferry.submit_arrays(core, t, op, raw[0], raw[1], raw[2], signed)
            _kvferry.transfer_arrays(core, t, op, raw[0], raw[1], raw[2], signed)
            return 0
        except InvalidArgument as e:  # arrays of different lengths, a negative item
            raise ValueError(e.reason) from None
        except KvferryError as e:
            return _fail(method, e.reason, fail)

    def batch_transfer_sync_write_arrays(self, target_hostname: str, buffers: Any, peer_buffer_addresses: Any, lengths: Any, transport_hint: str = "", nic_hint: str = "") -> int:
        """:meth:`batch_transfer_sync_write` with the descriptors as contiguous one-dimensional
        arrays of 8-byte integers (numpy ``uint64``/``int64``, ``array.array('Q')``, any
        buffer): read in native code, no per-element Python work. As in Mooncake 0.3.14: an
        array of another shape, item type or layout raises TypeError; arrays of different
        lengths or a negative int64 item, ValueError (nothing moves); a failed transfer is -1
        (reason logged)."""
        m = "batch_transfer_sync_write_arrays"
        return self._arrays_call(m, (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint), 1, False)

    def batch_transfer_sync_read_arrays(self, target_hostname: str, buffers: Any, peer_buffer_addresses: Any, lengths: Any, transport_hint: str = "", nic_hint: str = "") -> int:
        """:meth:`batch_transfer_sync_read` with descriptor arrays (see
        :meth:`batch_transfer_sync_write_arrays`)."""
        m = "batch_transfer_sync_read_arrays"
        return self._arrays_call(m, (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint), 0, False)

    def batch_transfer_async_write_arrays(self, target_hostname: str, buffers: Any, peer_buffer_addresses: Any, lengths: Any, transport_hint: str = "", nic_hint: str = "") -> int:
        """:meth:`batch_transfer_async_write` with descriptor arrays: the batch id, 0 on
        failure."""
        m = "batch_transfer_async_write_arrays"
        return self._arrays_call(m, (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint), 1, True)

    def batch_transfer_async_read_arrays(self, target_hostname: str, buffers: Any, peer_buffer_addresses: Any, lengths: Any, transport_hint: str = "", nic_hint: str = "") -> int:
        """:meth:`batch_transfer_async_read` with descriptor arrays: the batch id, 0 on
        failure."""
        m = "batch_transfer_async_read_arrays"
        return self._arrays_call(m, (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint), 0, True)

    def _pages_call(self, method: str, args: Tuple[Any, ...], op: int) -> int:
        try:
            t, _, th, nh = _s(args[0]), _u(args[4]), _s(args[5]), _s(args[6])
        except _Bad:
            raise _incompatible(method, _SIG[method], args) from None
        src = _array(args[1], "src_pages", method, args)
        dst = _array(args[2], "dst_pages", method, args)
        fields = _array(args[3], "fields", method, args, rows=5)
        core = self._need(method)
        if core is None:
            return -1
        if not self._hints(method, core, t, (th, nh)):
            return -1
        try:
            _kvferry.transfer_pages(core, t, op, src[0], dst[0], fields[0], (src[1], dst[1], fields[1]))
            return 0
        except InvalidArgument as e:  # a table that does not expand: nothing moved
            raise ValueError(e.reason) from None
        except KvferryError as e:
            return _fail(method, e.reason)

    def batch_transfer_sync_write_pages(self, target_hostname: str, src_pages: Any, dst_pages: Any, fields: Any, max_batch_size: int = 0, transport_hint: str = "", nic_hint: str = "") -> int:
        """Writes a page table: for each row ``(src_base, src_stride, dst_base, dst_stride,
        length)`` of ``fields`` (a C-contiguous ``[F, 5]`` array of 8-byte integers) and each
        ``i``, ``length`` bytes from local ``src_base + src_pages[i] * src_stride`` to remote
        ``dst_base + dst_pages[i] * dst_stride``: ``F * P`` copies, expanded and merged (where
        adjacent) inside the engine, one batch; blocks. ``max_batch_size`` (>= 0) is accepted:
        kvferry needs no cap on a batch's size. Returns 0, or -1 for a failed transfer (reason
        logged). A table that does not expand raises ValueError and moves nothing: page lists
        of different lengths, a row with length 0 or a negative value, a negative page, an
        address past 2**64 - 1 (Mooncake wraps such an address around; kvferry refuses it).
        Arrays of the wrong shape, item type or layout raise TypeError."""
        m = "batch_transfer_sync_write_pages"
        return self._pages_call(m, (target_hostname, src_pages, dst_pages, fields, max_batch_size, transport_hint, nic_hint), 1)

    def batch_transfer_sync_read_pages(self, target_hostname: str, src_pages: Any, dst_pages: Any, fields: Any, max_batch_size: int = 0, transport_hint: str = "", nic_hint: str = "") -> int:
        """Reads a page table (see :meth:`batch_transfer_sync_write_pages`; ``src`` is the
        local side, ``dst`` the remote one, as in Mooncake): remote
        ``dst_base + dst_pages[i] * dst_stride`` into local ``src_base + src_pages[i] *
        src_stride``."""
        m = "batch_transfer_sync_read_pages"
        return self._pages_call(m, (target_hostname, src_pages, dst_pages, fields, max_batch_size, transport_hint, nic_hint), 0)

    # -- scatter transfers with tickets (Mooncake 0.3.14) ---------------------------------

    def _scatter(self, method: str, args: Tuple[Any, ...], op: int, wait: bool) -> "ScatterTransferTicket":
        try:
            t = _s(args[0])
            flat = [_ul(a) for a in args[1:5]]
            nested = [[_ul(x) for x in _seq(a)] for a in args[5:8]]
        except _Bad:
            raise _incompatible(method, _SIG[method], args) from None
        core = self._need(method)
        if core is None:
            return ScatterTransferTicket._failed(_NOT_INITIALIZED)
        try:
            bid = _kvferry.submit_scatter(core, t, op, *flat, *nested)
        except KvferryError as e:
            # As Mooncake: a bad range or fragment, or a segment that cannot be opened, is a
            # ticket that ended FAILED_DRAINED (here nothing of it moved).
            _fail(method, e.reason)
            return ScatterTransferTicket._failed(e.reason)
        ticket = ScatterTransferTicket._of(core, bid)
        if wait:
            ticket._wait(None)
        return ticket

    def submit_scatter_write(self, endpoint: str, local_base_addresses: Sequence[int], local_capacities: Sequence[int], remote_base_addresses: Sequence[int], remote_capacities: Sequence[int],
                             local_offsets: Sequence[Sequence[int]], remote_offsets: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]) -> "ScatterTransferTicket":
        """Starts a scatter WRITE to ``endpoint`` and returns its :class:`ScatterTransferTicket`
        at once: for each range ``k`` and fragment ``j``, ``lengths[k][j]`` bytes from local
        ``local_base_addresses[k] + local_offsets[k][j]`` to remote
        ``remote_base_addresses[k] + remote_offsets[k][j]``, every fragment inside its range's
        capacities. Bad ranges (arrays of different sizes, a fragment outside its range, an
        address overflow) or a segment that cannot be opened give a ticket that ended
        ``FAILED_DRAINED`` (reason logged, nothing moved), as Mooncake's; no fragment at all,
        one that ended ``COMPLETED``."""
        m = "submit_scatter_write"
        return self._scatter(m, (endpoint, local_base_addresses, local_capacities, remote_base_addresses, remote_capacities, local_offsets, remote_offsets, lengths), 1, False)

    def submit_scatter_read(self, endpoint: str, local_base_addresses: Sequence[int], local_capacities: Sequence[int], remote_base_addresses: Sequence[int], remote_capacities: Sequence[int],
                            local_offsets: Sequence[Sequence[int]], remote_offsets: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]) -> "ScatterTransferTicket":
        """Starts a scatter READ (remote fragments into the local ranges); see
        :meth:`submit_scatter_write`."""
        m = "submit_scatter_read"
        return self._scatter(m, (endpoint, local_base_addresses, local_capacities, remote_base_addresses, remote_capacities, local_offsets, remote_offsets, lengths), 0, False)

    def scatter_transfer_sync_write_with_ticket(self, endpoint: str, local_base_addresses: Sequence[int], local_capacities: Sequence[int], remote_base_addresses: Sequence[int], remote_capacities: Sequence[int],
                                                local_offsets: Sequence[Sequence[int]], remote_offsets: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]) -> "ScatterTransferTicket":
        """:meth:`submit_scatter_write`, then waits until every fragment ended; the ticket
        says COMPLETED or FAILED_DRAINED."""
        m = "scatter_transfer_sync_write_with_ticket"
        return self._scatter(m, (endpoint, local_base_addresses, local_capacities, remote_base_addresses, remote_capacities, local_offsets, remote_offsets, lengths), 1, True)

    def scatter_transfer_sync_read_with_ticket(self, endpoint: str, local_base_addresses: Sequence[int], local_capacities: Sequence[int], remote_base_addresses: Sequence[int], remote_capacities: Sequence[int],
                                               local_offsets: Sequence[Sequence[int]], remote_offsets: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]) -> "ScatterTransferTicket":
        """:meth:`submit_scatter_read`, then waits until every fragment ended."""
        m = "scatter_transfer_sync_read_with_ticket"
        return self._scatter(m, (endpoint, local_base_addresses, local_capacities, remote_base_addresses, remote_capacities, local_offsets, remote_offsets, lengths), 0, True)
