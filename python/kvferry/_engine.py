"""kvferry's native Python API: :class:`Engine`.

Same operations as Mooncake's ``TransferEngine``, but failures raise typed exceptions
(:mod:`kvferry._errors`) that carry the reason, and local memory may be given as a buffer
object (``bytearray``, writable ``memoryview``, numpy array, ``mmap``, CPU torch tensor)
as well as an integer address. Every blocking call releases the GIL; an ``Engine`` may be
shared by any number of threads.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _kvferry
from ._buffers import address as _address
from ._buffers import as_u64 as _u64
from ._buffers import resolve as _resolve
from ._errors import InvalidArgument

__all__ = ["Engine", "Batch", "Opcode", "TaskStatus", "FailCause", "Status", "Notify", "Region"]

log = logging.getLogger("kvferry")

_NS = 1e-9  # the per-byte allowance of sync calls (Mooncake: timeout + length nanoseconds)


class Opcode(enum.IntEnum):
    """Direction of a transfer: READ (remote -> local) = 0, WRITE (local -> remote) = 1."""

    READ = 0
    WRITE = 1


TaskStatus = enum.IntEnum("TaskStatus", dict(_kvferry.task_status_names()))  # type: ignore[misc]
#: Why a task failed, as a code (``Status.cause``, ``TransferError.cause``): OTHER,
#: LOCAL_NOT_REGISTERED, REMOTE_NOT_REGISTERED, SEGMENT_NOT_FOUND, PEER_UNREACHABLE, PEER_LOST,
#: PROTOCOL, TIMEOUT, SHUT_DOWN. The reason text says the same for people.
FailCause = enum.IntEnum("FailCause", dict(_kvferry.fail_cause_names()))  # type: ignore[misc]
TaskStatus.__doc__ = """Mooncake's task status values: WAITING=0, PENDING=1, INVALID=2, CANCELED=3,
COMPLETED=4, TIMEOUT=5, FAILED=6."""
TaskStatus.__module__ = __name__

_TERMINAL = frozenset((3, 4, 5, 6))


class Status(NamedTuple):
    """Status of a batch or a task."""

    status: "TaskStatus"
    transferred_bytes: int
    reason: Optional[str]
    #: Why it failed, as a code (None unless FAILED or TIMEOUT).
    cause: Optional["FailCause"] = None

    @property
    def done(self) -> bool:
        """True once COMPLETED, FAILED, TIMEOUT or CANCELED."""
        return int(self.status) in _TERMINAL

    @property
    def ok(self) -> bool:
        """True when COMPLETED."""
        return int(self.status) == 4


class Notify(NamedTuple):
    """A notify message: ``name`` (by default the sender's segment name) and ``msg``."""

    name: str
    msg: str


class Region(NamedTuple):
    """A registered range: ``addr``, ``length``, ``location`` (e.g. ``cpu:0`` or ``*``)."""

    addr: int
    length: int
    location: str


# -- fork() ---------------------------------------------------------------------------------
#
# vLLM and SGLang fork worker processes. A child inherits copies of the parent's engines (and
# stores), whose sockets, threads and shared memory belong to the parent: their methods raise
# in the child (the native core checks the process id) and dropping them there only forgets
# them. Views of managed memory are released in the child: that memory is not inherited
# (MADV_DONTFORK), so touching it would crash the child instead of raising.

_live_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Writable memoryviews are unhashable: keyed by id, dropped by the weakref's callback.
_live_views: Dict[int, "weakref.ref[memoryview]"] = {}


def _track_view(view: memoryview) -> None:
    key = id(view)
    _live_views[key] = weakref.ref(view, lambda _r, key=key: _live_views.pop(key, None))


def _after_fork_in_child() -> None:
    for r in list(_live_views.values()):
        v = r()
        if v is None:
            continue
        try:
            v.release()
        except (BufferError, ValueError):  # exported further: it stays, and so does the risk
            pass
    for e in list(_live_engines):
        try:
            e._inherited = True
            # The parent's sockets and control region: released here, so that the parent's
            # ports close when it does, whatever this process goes on doing.
            e._core.release_inherited()
        except AttributeError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _ViewGuard:
    """Attached to the ctypes array under a view from :meth:`Engine.view`: keeps the engine's
    core (whose managed mappings live as long as it does) and the registration's pin alive."""

    __slots__ = ("core", "pin", "addr", "__weakref__")

    def __init__(self, core: Any, pin: Any, addr: int) -> None:
        self.core = core
        self.pin = pin
        self.addr = addr


def _status(t: Tuple[int, int, Optional[str], Optional[int]]) -> Status:
    return Status(TaskStatus(t[0]), t[1], t[2], None if t[3] is None else FailCause(t[3]))


def _as_type_error(e: Exception) -> InvalidArgument:
    return InvalidArgument(str(e), -1)


def _opcode(opcode: Any) -> int:
    try:
        op = int(_u64(opcode, "opcode"))
    except InvalidArgument:
        raise InvalidArgument("opcode must be Opcode.READ (0) or Opcode.WRITE (1), not %r" % (opcode,), -1) from None
    if op not in (0, 1):
        raise InvalidArgument("opcode must be Opcode.READ (0) or Opcode.WRITE (1), not %r" % (opcode,), -1)
    return op


def _notify_parts(notify: Any) -> Tuple[Optional[str], str]:
    if isinstance(notify, str):
        return None, notify
    name = getattr(notify, "name", None)
    msg = getattr(notify, "msg", None)
    if not isinstance(msg, str) or not (name is None or isinstance(name, str)):
        raise InvalidArgument("notify must be a str message or have str .name and .msg (kvferry.Notify)", -1)
    return name, msg


class Batch:
    """An asynchronous batch returned by :meth:`Engine.submit`.

    Poll it with :meth:`status`, block with :meth:`wait`, then :meth:`free` it (or use it as a
    context manager, which releases it on exit: freed at once if finished, else as soon as it
    finishes). Buffers given to ``submit`` stay pinned (see :mod:`kvferry._buffers`) until the
    engine has freed the batch, which happens only once every task is terminal: releasing a
    batch early never lets a sibling task write into memory that was handed back.
    """

    __slots__ = ("_core", "id", "segment", "size", "deadline", "_keep", "_released")

    def __init__(self, core: Any, batch_id: int, segment: str, size: int, deadline_s: float, keep: Any) -> None:
        self._core = core
        self.id: int = batch_id
        self.segment: str = segment
        self.size: int = size
        self.deadline: float = deadline_s
        self._keep = keep
        self._released = False

    def status(self) -> Status:
        """Aggregate status: WAITING while any task is in flight; once every task is terminal,
        COMPLETED if all completed, else the first failed task's FAILED/TIMEOUT. Never blocks."""
        return _status(self._core.batch_status(self.id))

    def task_status(self, index: int) -> Status:
        """Status of request ``index`` (0-based, in submission order)."""
        return _status(self._core.task_status(self.id, _u64(index, "index")))

    def wait(self, timeout: Optional[float] = None, *, check: bool = True) -> Status:
        """Blocks until every task is terminal (not only until the first failure) or ``timeout``
        seconds passed (default: no limit but the requests' own deadlines, by which each ends:
        the transfer timeout plus 1 ns per byte). A terminal status is final: nothing of the
        batch lands in its buffers afterwards. With ``check`` (default), raises
        TransferError/TransferTimeout/AddressNotRegistered unless COMPLETED (TransferTimeout
        too when ``timeout`` passed first: the batch is then still in flight)."""
        st = _status(self._core.wait_batch(self.id, None if timeout is None else float(timeout)))
        if check and not st.ok:
            if not st.done:
                st = Status(TaskStatus.TIMEOUT, st.transferred_bytes, "still in flight after %.3f s (its buffers stay in use until it ends)" % timeout)
            raise _kvferry.transfer_error(self.segment, int(st.status), st.transferred_bytes, st.reason, None if st.cause is None else int(st.cause))
        return st

    @property
    def done(self) -> bool:
        return self.status().done

    def free(self) -> None:
        """Frees the batch. Raises BatchBusy while a task is in flight."""
        if not self._released:
            self._core.free_batch(self.id)  # drops the native pins: every task is terminal
            self._released = True
            self._keep = None

    def release(self) -> None:
        """Frees the batch now if finished, otherwise as soon as it finishes. Idempotent."""
        if not self._released:
            self._released = True
            # The native core holds the pins until the engine frees the batch (every task
            # terminal); this object's reference is only a second one.
            self._core.release_batch(self.id)
            self._keep = None

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        # A batch dropped without free() or release() (its wait() raised, say) is released,
        # so the engine's batch and its buffers' pins go once its tasks are terminal.
        try:
            self.release()
        except Exception:  # a fork() child's copy, or the interpreter shutting down
            pass

    def __repr__(self) -> str:
        return "<kvferry.Batch id=%d segment=%r requests=%d>" % (self.id, self.segment, self.size)


class Engine:
    """A kvferry transfer engine (native API).

    ``Engine(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", *, protocol="tcp",
    device_name="")`` starts listeners on ``local_hostname`` (``host`` or ``host:port``; the
    port part is ignored in P2P mode, as in Mooncake) at random ports of
    ``KVFERRY_MIN_PORT``..``KVFERRY_MAX_PORT`` (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``).
    Peers address this engine by :attr:`segment_name` (``host:rpc_port``).

    ``metadata_server`` is ``"P2PHANDSHAKE"`` (peers exchange descriptors directly) or a
    metadata service (``http(s)://host:port/metadata``, ``etcd://...``, ``redis://...``); an
    unsupported or unreachable one raises ConfigError/KvferryError naming it. ``protocol`` may
    be ``"tcp"`` or ``"rdma"``, as in Mooncake's ``initialize``: ``"rdma"`` makes the engine
    RDMA-only (it publishes an RDMA segment descriptor; ConfigError, saying why, where this
    host has no usable RDMA NIC); ``"tcp"`` leaves the path as configured
    (``KVFERRY_TRANSPORT``, default ``auto``: shared memory to kvferry peers on this host, RDMA
    to peers that publish RDMA devices when this host has a usable RDMA port
    (``kvferry.features()["rdma"]``), TCP otherwise). An explicit ``KVFERRY_TRANSPORT``, or
    ``MC_FORCE_TCP=1``, wins over ``protocol``. ``device_name``: the RDMA NICs to use,
    comma-separated (``""``: every NIC with an active port).

    Local memory arguments accept an integer address or a writable contiguous buffer;
    remote addresses are integers inside buffers the peer registered
    (:meth:`segment_buffers`). Raises subclasses of :class:`kvferry.KvferryError`.
    """

    def __init__(
        self,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        *,
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        for what, v in (("local_hostname", local_hostname), ("metadata_server", metadata_server), ("protocol", protocol), ("device_name", device_name)):
            if not isinstance(v, str):
                raise InvalidArgument("%s must be a str, not %s" % (what, type(v).__name__), -1)
        if protocol not in ("tcp", "rdma", ""):
            raise InvalidArgument("protocol %r is not supported: use \"tcp\" or \"rdma\"" % protocol, -1)
        self._init(_kvferry.Core(local_hostname, metadata_server, protocol, device_name))

    def _init(self, core: Any) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._inherited = False
        # Live views of managed buffers, by buffer address (see view()).
        self._views: Dict[int, "weakref.WeakSet[_ViewGuard]"] = {}
        _live_engines.add(self)

    @classmethod
    def _from_core(cls, core: Any) -> "Engine":
        self = cls.__new__(cls)
        self._init(core)
        return self

    # -- identity ------------------------------------------------------------------------

    @property
    def segment_name(self) -> str:
        """``host:rpc_port``: the name peers pass as ``segment`` / ``target_hostname``."""
        return self._core.segment_name

    @property
    def rpc_port(self) -> int:
        """The handshake (RPC) port (Mooncake's ``get_rpc_port()``)."""
        return self._core.rpc_port

    @property
    def data_port(self) -> int:
        """The TCP data port."""
        return self._core.data_port

    @property
    def transfer_timeout(self) -> float:
        """Seconds before an unfinished request fails (``KVFERRY_TRANSFER_TIMEOUT`` /
        ``MC_TRANSFER_TIMEOUT``). Sync calls wait this long plus 1 ns per byte."""
        return self._core.transfer_timeout

    @property
    def closed(self) -> bool:
        return self._core.closed

    # -- memory --------------------------------------------------------------------------

    def register_memory(self, buffer: Any, length: Optional[int] = None, location: str = "*") -> int:
        """Registers ``buffer`` (an address plus ``length``, or a writable buffer whose size
        is the default length) so peers may read and write it. Returns its address. A
        buffer object is kept alive until unregistered. Raises AddressOverlap,
        InvalidArgument."""
        return self.register_memory_batch([buffer], None if length is None else [length], location)[0]

    def register_memory_batch(self, buffers: Sequence[Any], lengths: Optional[Sequence[Optional[int]]] = None, location: str = "*") -> List[int]:
        """Registers several buffers, all or none. Returns their addresses."""
        if not isinstance(location, str):
            raise InvalidArgument("location must be a str, not %s" % type(location).__name__, -1)
        buffers = list(buffers)
        if lengths is None:
            lengths = [None] * len(buffers)
        lengths = list(lengths)
        if len(lengths) != len(buffers):
            raise InvalidArgument("%d buffers but %d lengths" % (len(buffers), len(lengths)), -1)
        resolved = [_resolve(b, n, "buffer") for b, n in zip(buffers, lengths)]
        addrs = [r[0] for r in resolved]
        # The native core holds each pin until the range is unregistered (after the barrier).
        self._core.register(addrs, [r[1] for r in resolved], location, [r[2] for r in resolved])
        return addrs

    def unregister_memory(self, buffer: Any) -> None:
        """Unregisters the range starting at ``buffer`` (address or the registered object).
        Waits for accesses in progress. Raises AddressNotRegistered."""
        self.unregister_memory_batch([buffer])

    def unregister_memory_batch(self, buffers: Sequence[Any]) -> None:
        """Unregisters several ranges, all or none."""
        addrs = [_address(b, "buffer")[0] for b in buffers]
        self._core.unregister(addrs)  # drops the pins once no access is in progress

    def registered(self) -> List[Region]:
        """The registered ranges, in address order."""
        return [Region(*r) for r in self._core.registered()]

    def allocate_managed_buffer(self, length: int, location: str = "cpu:0") -> int:
        """Maps ``length`` bytes of zeroed, page-aligned memory, registers it and returns its
        address. Release it with :meth:`free_managed_buffer` (or :meth:`close`)."""
        return self._core.allocate_managed(_u64(length, "length"), location)

    def free_managed_buffer(self, address: int) -> None:
        """Unregisters and unmaps a buffer from :meth:`allocate_managed_buffer`. Raises
        BufferError while a :meth:`view` of it exists (release the view first)."""
        a = _u64(address, "address")
        for start, length in self._core.managed_buffers():
            if start <= a < start + length and self._views.get(start):
                raise BufferError("0x%x has %d live view(s) from Engine.view(); release them (memoryview.release() or del) before freeing it" % (start, len(self._views[start])))
        if not self._core.free_managed(a):
            raise InvalidArgument("0x%x is not an address returned by allocate_managed_buffer" % address, -3)

    def view(self, address: int, length: int) -> memoryview:
        """A writable memoryview of ``length`` bytes at ``address``, which must lie inside
        registered memory (e.g. a managed buffer).

        The view keeps its memory valid for as long as it exists: a managed buffer cannot be
        freed meanwhile (:meth:`free_managed_buffer` raises BufferError; :meth:`close` leaves
        it mapped until the last view is gone), and a buffer object registered with
        :meth:`register_memory` stays alive and pinned. Memory registered by integer address
        is the caller's: the view cannot keep it alive. In a fork() child, views made in the
        parent are released (using them raises ValueError)."""
        a, n = _u64(address, "address"), _u64(length, "length")
        for r in self._core.registered():
            if r[0] <= a and a + n <= r[0] + r[1]:
                break
        else:
            raise InvalidArgument("[0x%x, +%d) is not inside registered memory" % (a, n), -3)
        if r[2].startswith("cuda"):
            # The CPU never touches GPU memory: a view of a device pointer would crash.
            raise InvalidArgument("[0x%x, +%d) is GPU memory (%s), which the CPU cannot view; move it with a transfer" % (a, n, r[2]), -3)
        managed = next((m for m in self._core.managed_buffers() if m[0] <= a and a + n <= m[0] + m[1]), None)
        guard = _ViewGuard(self._core, self._core.pin_of(a, n), a)
        arr = (ctypes.c_char * n).from_address(a)
        arr._kvferry_guard = guard  # type: ignore[attr-defined]  # the view holds arr, arr holds the guard
        if managed is not None:
            with self._lock:
                self._views.setdefault(managed[0], weakref.WeakSet()).add(guard)
        view = memoryview(arr).cast("B")
        _track_view(view)
        return view

    def write_bytes(self, address: int, data: Union[bytes, bytearray, memoryview]) -> None:
        """Copies ``data`` to ``address`` (the kernel checks the range: a bad address raises
        InvalidArgument instead of crashing)."""
        self._core.write_memory(_u64(address, "address"), bytes(data))

    def read_bytes(self, address: int, length: int) -> bytes:
        """Copies ``length`` bytes from ``address`` (checked like :meth:`write_bytes`)."""
        return self._core.read_memory(_u64(address, "address"), _u64(length, "length"))

    # -- segments ------------------------------------------------------------------------

    def open_segment(self, segment: str) -> int:
        """Opens a peer segment (``host:rpc_port``), fetching its descriptor; returns its
        handle. Raises SegmentNotFound."""
        return self._core.open_segment(_str(segment, "segment"))

    def segment_buffers(self, segment: str) -> List[Region]:
        """The buffers ``segment`` registered (remote addresses to transfer to or from)."""
        return [Region(*r) for r in self._core.segment_buffers(_str(segment, "segment"))]

    # -- transfers -----------------------------------------------------------------------

    def _requests(self, locals_: Any, remotes: Any, lengths: Any) -> Tuple[List[int], List[int], List[int], Any]:
        locals_ = list(locals_)
        remotes = list(remotes)
        n = len(locals_)
        if lengths is None:
            lengths = [None] * n
        else:
            lengths = list(lengths)
        if len(remotes) != n or len(lengths) != n:
            raise InvalidArgument(
                "buffers, remote addresses and lengths must have the same number of entries (got %d, %d and %d)"
                % (n, len(remotes), len(lengths)),
                -1,
            )
        keep: List[Any] = []
        if all(type(x) is int for x in locals_) and all(type(x) is int for x in lengths) and all(type(x) is int for x in remotes):
            for x in locals_:
                _u64(x, "buffer")
            for x in remotes:
                _u64(x, "remote address")
            for x in lengths:
                _u64(x, "length")
            return locals_, remotes, lengths, None
        addrs, lens = [], []
        for b, n_ in zip(locals_, lengths):
            a, ln, k = _resolve(b, n_, "buffer")
            addrs.append(a)
            lens.append(ln)
            if k is not None:
                keep.append(k)
        return addrs, [_u64(r, "remote address") for r in remotes], lens, keep

    def _timeout(self, timeout: Optional[float], total: int) -> float:
        if timeout is None:
            return self._core.transfer_timeout + total * _NS
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidArgument("timeout must be a number of seconds >= 0, not %r" % (timeout,), -1)
        return float(timeout)

    def batch_transfer(
        self,
        segment: str,
        buffers: Sequence[Any],
        remote_addresses: Sequence[int],
        lengths: Optional[Sequence[Optional[int]]] = None,
        opcode: Union[Opcode, int] = Opcode.WRITE,
        *,
        timeout: Optional[float] = None,
        notify: Any = None,
    ) -> int:
        """Moves ``lengths[i]`` bytes between local ``buffers[i]`` and ``remote_addresses[i]``
        of ``segment`` in one batch and waits. WRITE: local -> remote, READ: remote -> local.
        ``timeout`` defaults to :attr:`transfer_timeout` + 1 ns per byte. ``notify`` (a str
        or :class:`Notify`) is sent to the segment after success. Returns the bytes moved.

        Raises SegmentNotFound, AddressNotRegistered, TransferError, TransferTimeout."""
        seg = _str(segment, "segment")
        op = _opcode(opcode)
        addrs, remotes, lens, keep = self._requests(buffers, remote_addresses, lengths)
        t = self._timeout(timeout, sum(lens))
        try:
            # The native core holds the pins until every task is terminal.
            n = self._core.transfer(seg, op, addrs, remotes, lens, t, keep or None)
        except (TypeError, OverflowError) as e:
            raise _as_type_error(e) from None
        del keep
        if notify is not None:
            name, msg = _notify_parts(notify)
            self._core.send_notify(seg, msg, name)
        return n

    def batch_write(self, segment: str, buffers: Sequence[Any], remote_addresses: Sequence[int], lengths: Optional[Sequence[Optional[int]]] = None, *, timeout: Optional[float] = None, notify: Any = None) -> int:
        """:meth:`batch_transfer` with WRITE (local -> remote)."""
        return self.batch_transfer(segment, buffers, remote_addresses, lengths, Opcode.WRITE, timeout=timeout, notify=notify)

    def batch_read(self, segment: str, buffers: Sequence[Any], remote_addresses: Sequence[int], lengths: Optional[Sequence[Optional[int]]] = None, *, timeout: Optional[float] = None, notify: Any = None) -> int:
        """:meth:`batch_transfer` with READ (remote -> local)."""
        return self.batch_transfer(segment, buffers, remote_addresses, lengths, Opcode.READ, timeout=timeout, notify=notify)

    def transfer(self, segment: str, buffer: Any, remote_address: int, length: Optional[int] = None, opcode: Union[Opcode, int] = Opcode.WRITE, *, timeout: Optional[float] = None, notify: Any = None) -> int:
        """One request: see :meth:`batch_transfer`. Returns the bytes moved."""
        return self.batch_transfer(segment, [buffer], [remote_address], [length], opcode, timeout=timeout, notify=notify)

    def write(self, segment: str, buffer: Any, remote_address: int, length: Optional[int] = None, *, timeout: Optional[float] = None, notify: Any = None) -> int:
        """Writes local ``buffer`` to ``remote_address`` of ``segment`` and waits."""
        return self.batch_transfer(segment, [buffer], [remote_address], [length], Opcode.WRITE, timeout=timeout, notify=notify)

    def read(self, segment: str, buffer: Any, remote_address: int, length: Optional[int] = None, *, timeout: Optional[float] = None) -> int:
        """Reads ``remote_address`` of ``segment`` into local ``buffer`` and waits."""
        return self.batch_transfer(segment, [buffer], [remote_address], [length], Opcode.READ, timeout=timeout)

    def submit(self, segment: str, buffers: Sequence[Any], remote_addresses: Sequence[int], lengths: Optional[Sequence[Optional[int]]] = None, opcode: Union[Opcode, int] = Opcode.WRITE) -> Batch:
        """Submits one batch and returns at once; see :class:`Batch`. Problems with single
        requests (unregistered ranges) show up as FAILED tasks; a bad segment raises
        SegmentNotFound here."""
        seg = _str(segment, "segment")
        op = _opcode(opcode)
        addrs, remotes, lens, keep = self._requests(buffers, remote_addresses, lengths)
        deadline = time.monotonic() + self._core.transfer_timeout + sum(lens) * _NS
        try:
            bid = self._core.submit(seg, op, addrs, remotes, lens, keep or None)
        except (TypeError, OverflowError) as e:
            raise _as_type_error(e) from None
        return Batch(self._core, bid, seg, len(addrs), deadline, None)

    def submit_write(self, segment: str, buffers: Sequence[Any], remote_addresses: Sequence[int], lengths: Optional[Sequence[Optional[int]]] = None) -> Batch:
        """:meth:`submit` with WRITE."""
        return self.submit(segment, buffers, remote_addresses, lengths, Opcode.WRITE)

    def submit_read(self, segment: str, buffers: Sequence[Any], remote_addresses: Sequence[int], lengths: Optional[Sequence[Optional[int]]] = None) -> Batch:
        """:meth:`submit` with READ."""
        return self.submit(segment, buffers, remote_addresses, lengths, Opcode.READ)

    # -- notifies and liveness -----------------------------------------------------------

    def send_notify(self, segment: str, msg: str, name: Optional[str] = None) -> None:
        """Sends a notify to ``segment`` (delivered to its ``get_notifies()``). ``name``
        defaults to this engine's segment name. Raises PeerUnreachable, SegmentNotFound."""
        if name is not None and not isinstance(name, str):
            raise InvalidArgument("name must be a str, not %s" % type(name).__name__, -1)
        self._core.send_notify(_str(segment, "segment"), _str(msg, "msg"), name)

    def get_notifies(self) -> List[Notify]:
        """Drains the notifies received so far."""
        return [Notify(*n) for n in self._core.get_notifies()]

    def wait_notifies(self, timeout: Optional[float] = None) -> List[Notify]:
        """Like :meth:`get_notifies`, but waits up to ``timeout`` seconds (default: forever)
        for the first one."""
        t = 1e9 if timeout is None else self._timeout(timeout, 0)
        return [Notify(*n) for n in self._core.wait_notifies(t)]

    def probe(self, segment: str) -> None:
        """Checks that ``segment``'s handshake port answers. Raises PeerUnreachable (code
        -102) or SegmentNotFound (code -101, malformed name)."""
        self._core.probe(_str(segment, "segment"))

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stops the engine (listeners close, queued requests fail, managed buffers are
        unmapped, pins dropped). Further calls raise EngineClosed. Idempotent. Managed
        buffers with live :meth:`view` s stay mapped until the last view is gone. In a fork()
        child it raises EngineClosed (the engine is the parent's)."""
        with self._lock:
            viewed = any(len(s) for s in self._views.values())
        self._core.close(not viewed)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._inherited:
            return "<kvferry.Engine inherited from process %d>" % (self._core.owner_pid,)
        if self._core.closed:
            return "<kvferry.Engine closed>"
        return "<kvferry.Engine segment=%r>" % (self._core.segment_name,)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise InvalidArgument("%s must be a str, not %s" % (what, type(v).__name__), -1)
    return v


def features() -> Dict[str, bool]:
    """What this build can move, decided at run time (``{"tcp": True, "cuda": ..., ...}``).
    ``cuda`` is True when the CUDA driver (libcuda.so.1, loaded at run time) can stage GPU memory."""
    return dict(_kvferry.features())
