"""Mooncake's ``mooncake.engine`` API on kvferry.

Same class and method names, argument names, defaults and return conventions as the
``mooncake.engine`` module of the ``mooncake-transfer-engine`` wheels (pybind11), so code
written for Mooncake runs unchanged::

    from kvferry.mooncake.engine import TransferEngine   # or, with the shim on,
    from mooncake.engine import TransferEngine           # (see kvferry.install_mooncake_shim)

Conventions (as in Mooncake): methods return ``0`` on success and a negative code on
failure, address/batch-returning methods return ``0`` on failure, and arguments of the
wrong type (or negative / >= 2**64 integers) raise ``TypeError``. Each failure logs its
reason once, as a WARNING of the ``logging`` logger ``"kvferry"``.

Where Mooncake would crash the interpreter (any call before ``initialize``, bad addresses
given to ``read_bytes_from_buffer``/``write_bytes_to_buffer``, unknown batch ids), this
module logs and returns the failure value instead.
"""

from __future__ import annotations

import enum
import os
import threading
from typing import Any, List, Optional, Tuple

from .. import _kvferry
from .._engine import Engine as _Engine
from .._engine import _live_engines
from .._errors import InvalidArgument, KvferryError
from ._args import _NOT_INITIALIZED, _SIG, _Bad, _data, _fail, _incompatible, _opt_s, _s, _u, _ul, _warn_once, log
from . import _cuda
from ._v314 import ScatterTransferCompletionStatus, ScatterTransferTicket, _Calls314

__all__ = [
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "InnerTransferEngine",
    "ScatterTransferCompletionStatus",
    "ScatterTransferTicket",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
]


_features = _kvferry.features()
#: Build-feature flags, computed at run time from what kvferry can really move: SUPPORT_CUDA is
#: True where the CUDA driver is usable (GPU memory staged through pinned host buffers) and has
#: cuStreamSynchronize, so that the ``*_on_cuda`` calls, bound only then (as in Mooncake), work;
#: the others are False in this version.
_cuda._SYNC = _cuda.stream_sync() if _features.get("cuda", False) else None
SUPPORT_CUDA: bool = _cuda._SYNC is not None
SUPPORT_EFA: bool = bool(_features.get("efa", False))
SUPPORT_HIP: bool = bool(_features.get("hip", False))
SUPPORT_INTRA_NVLINK: bool = bool(_features.get("intra_nvlink", False))
SUPPORT_MNNVL: bool = bool(_features.get("mnnvl", False))
SUPPORT_MUSA: bool = bool(_features.get("musa", False))


class TransferOpcode(enum.IntEnum):
    """Transfer direction: ``Read`` (remote -> local) = 0, ``Write`` (local -> remote) = 1."""

    Read = 0
    Write = 1

    def __str__(self) -> str:
        return "TransferOpcode.%s" % self.name


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notify message delivered to the target's ``get_notifies()`` after a transfer:
    ``TransferNotify(name, msg)``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg) == (other.name, other.msg)

    def __hash__(self) -> int:
        return hash((self.name, self.msg))

    def __repr__(self) -> str:
        return "TransferNotify(name=%r, msg=%r)" % (self.name, self.msg)


#: What ``get_engine()`` returns: kvferry's native engine sharing this object's engine.
InnerTransferEngine = _Engine


# -- argument checking, pybind11 style (the rest in ._args) -------------------------------

def _op(v: Any) -> int:
    if isinstance(v, TransferOpcode):
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
        return v
    raise _Bad


def _notify(v: Any) -> Optional[Tuple[str, str]]:
    if v is None:
        return None
    name, msg = getattr(v, "name", None), getattr(v, "msg", None)
    if isinstance(name, str) and isinstance(msg, str):
        return name, msg
    raise _Bad


def _with_default_port(name: str) -> str:
    """A peer name without a port gets Mooncake's default handshake port (MC_HANDSHAKE_PORT,
    12001), as Mooncake's probe does."""
    port = os.environ.get("MC_HANDSHAKE_PORT", "12001")
    if not name:
        return name
    if name.startswith("["):
        return name if "]:" in name else "%s:%s" % (name, port)
    colons = name.count(":")
    if colons == 0:
        return "%s:%s" % (name, port)
    if colons == 1:
        return name
    return "[%s]:%s" % (name, port)  # a bare IPv6 literal


class TransferEngine(_Calls314, *((_cuda._OnCuda,) if SUPPORT_CUDA else ())):  # type: ignore[misc]
    """Mooncake's ``TransferEngine`` on kvferry. Create it, then call :meth:`initialize`.

    Safe to share between threads; every blocking call releases the GIL.
    """

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._core: Any = None
        self._native: Optional[_Engine] = None
        self._init_lock = threading.Lock()
        # The at-fork handler lets a child release the parent engine's sockets and control
        # region (`_core.release_inherited()`), as for kvferry's own engines.
        _live_engines.add(self)

    # -- setup ---------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Starts the engine. ``local_hostname`` is ``host`` or ``host:port`` (P2P mode picks
        the RPC port itself, as Mooncake does); ``metadata_server`` must be
        ``"P2PHANDSHAKE"`` (peers exchange descriptors directly) or a metadata service the
        engine supports (otherwise -1, with the reason logged). ``protocol="rdma"``: RDMA
        only, as a Mooncake RDMA engine: the engine publishes an RDMA segment descriptor
        (Mooncake's RDMA initiators reach it), and where this host has no usable RDMA NIC
        initialize returns -1, logging why and what to do. ``"tcp"`` (or anything else): the
        transport as configured (``KVFERRY_TRANSPORT``, default ``auto``: a TCP descriptor,
        shared memory to kvferry peers on this host, RDMA towards peers that publish it when
        this host has a usable port). An explicit ``KVFERRY_TRANSPORT``, or Mooncake's
        ``MC_FORCE_TCP=1``, wins over ``protocol``. ``device_name``: the RDMA NICs to use,
        comma-separated (``"mlx5_0,mlx5_1"``; ``""``: every NIC with an active port); with
        ``MC_TE_FILTERS``/``KVFERRY_RDMA_DEVICES`` set too, the NICs both name. Returns 0,
        or -1 (reason logged). Calling it again replaces the engine, as in Mooncake."""
        args = (local_hostname, metadata_server, protocol, device_name)
        try:
            host, meta, proto, dev = _s(local_hostname), _s(metadata_server), _s(protocol), _s(device_name)
        except _Bad:
            raise _incompatible("initialize", _SIG["initialize"], args) from None
        return self._start("initialize", host, meta, proto, dev, None)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str) -> int:
        """Like :meth:`initialize` with Mooncake's explicit ``metadata_type`` (``"etcd"``,
        ``"redis"``, ``"http"``), which prefixes a ``metadata_server`` that has no scheme."""
        args = (local_hostname, metadata_server, protocol, device_name, metadata_type)
        try:
            host, meta, proto, dev, mtype = (_s(a) for a in args)
        except _Bad:
            raise _incompatible("initialize_ext", _SIG["initialize_ext"], args) from None
        return self._start("initialize_ext", host, meta, proto, dev, mtype)

    def _start(self, method: str, host: str, meta: str, proto: str, dev: str, mtype: Optional[str]) -> int:
        # Mooncake: P2PHANDSHAKE as is; otherwise "<metadata_type>://<metadata_server>" for
        # initialize_ext, and the server string itself (bare host:port = etcd) for initialize.
        if mtype and meta != "P2PHANDSHAKE" and "://" not in meta:
            meta = "%s://%s" % (mtype, meta)
        if proto.strip().lower() not in ("tcp", "rdma", ""):
            log.info("kvferry: protocol %r requested; the transport is as configured (KVFERRY_TRANSPORT, default auto: shared memory, RDMA or TCP per peer)", proto)
        try:
            core = _kvferry.Core(host, meta, proto, dev)
        except KvferryError as e:
            return _fail(method, e.reason)
        with self._init_lock:
            old, old_native, self._core, self._native = self._core, self._native, core, None
        if old is not None:
            log.warning("%s: called again; the previous engine (%s) is closed", method, old)
            try:
                if old_native is not None and old_native._core is old:
                    old_native.close()  # managed buffers with live views stay mapped
                else:
                    old.close()
            except KvferryError as e:  # the parent's engine, inherited through fork()
                log.debug("%s: the previous engine was not closed here: %s", method, e)
        return 0

    def _need(self, method: str) -> Any:
        core = self._core
        if core is None:
            log.warning("%s failed: %s", method, _NOT_INITIALIZED)
        return core

    def get_rpc_port(self) -> int:
        """The handshake (RPC) port; the P2P segment name is ``"<host>:<rpc_port>"``."""
        core = self._need("get_rpc_port")
        if core is None:
            return -1
        try:
            return core.rpc_port
        except KvferryError as e:
            return _fail("get_rpc_port", e.reason)

    def get_engine(self) -> Optional[_Engine]:
        """The native engine (:class:`kvferry.Engine`) sharing this object's engine, or None
        before initialize."""
        core = self._need("get_engine")
        if core is None:
            return None
        with self._init_lock:
            if self._native is None or self._native._core is not core:
                self._native = _Engine._from_core(core)
            return self._native

    def get_engine_ptr(self) -> int:
        """Mooncake returns a C++ pointer for MooncakeDistributedStore; kvferry has none: 0."""
        return _fail("get_engine_ptr", "kvferry has no C++ engine to share (mooncake.store is not supported)", 0)

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """The NIC topology matrix as JSON. kvferry uses TCP only, so it lists no RDMA
        devices: ``"{}\\n"``, as Mooncake prints on a host without them."""
        try:
            _opt_s(device_name)
        except _Bad:
            raise _incompatible("get_local_topology", _SIG["get_local_topology"], (device_name,)) from None
        return "{}\n"

    # -- memory --------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*", remote_accessible: bool = True) -> int:
        """Registers ``[buffer_addr, buffer_addr + capacity)``. Returns 0, -1 (invalid:
        zero length, null, bad location), -7 (overlaps a registered range).
        ``remote_accessible=False`` (Mooncake: a local-only buffer, not published to peers):
        kvferry registers it as usual -- peers can reach every range this engine registered
        -- and logs that once."""
        try:
            a, n, loc = _u(buffer_addr), _u(capacity), _s(location)
            if not isinstance(remote_accessible, bool):
                raise _Bad
        except _Bad:
            raise _incompatible("register_memory", _SIG["register_memory"], (buffer_addr, capacity, location, remote_accessible)) from None
        if not remote_accessible:
            _warn_once("register_memory(remote_accessible=False): kvferry publishes every registered range to peers; the range at 0x%x is registered and reachable by them" % a)
        core = self._need("register_memory")
        if core is None:
            return -1
        try:
            core.register([a], [n], loc)
            return 0
        except KvferryError as e:
            return _fail("register_memory", e.reason, e.code or -1)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the range starting at ``buffer_addr``. Returns 0 or -3."""
        try:
            a = _u(buffer_addr)
        except _Bad:
            raise _incompatible("unregister_memory", _SIG["unregister_memory"], (buffer_addr,)) from None
        core = self._need("unregister_memory")
        if core is None:
            return -1
        try:
            core.unregister([a])
            return 0
        except KvferryError as e:
            return _fail("unregister_memory", e.reason, e.code or -1)

    def batch_register_memory(self, buffer_addresses: List[int], capacities: List[int], location: str = "*") -> int:
        """Registers several ranges (all or none). Extra capacities are ignored and fewer
        capacities than addresses is -1, as in Mooncake."""
        try:
            addrs, caps, loc = _ul(buffer_addresses), _ul(capacities), _s(location)
        except _Bad:
            raise _incompatible("batch_register_memory", _SIG["batch_register_memory"], (buffer_addresses, capacities, location)) from None
        core = self._need("batch_register_memory")
        if core is None:
            return -1
        if len(caps) < len(addrs):
            return _fail("batch_register_memory", "%d addresses but only %d capacities" % (len(addrs), len(caps)))
        try:
            core.register(addrs, caps[: len(addrs)], loc)
            return 0
        except KvferryError as e:
            return _fail("batch_register_memory", e.reason, e.code or -1)

    def batch_unregister_memory(self, buffer_addresses: List[int]) -> int:
        """Unregisters several ranges (all or none). Returns 0 or -3."""
        try:
            addrs = _ul(buffer_addresses)
        except _Bad:
            raise _incompatible("batch_unregister_memory", _SIG["batch_unregister_memory"], (buffer_addresses,)) from None
        core = self._need("batch_unregister_memory")
        if core is None:
            return -1
        try:
            core.unregister(addrs)
            return 0
        except KvferryError as e:
            return _fail("batch_unregister_memory", e.reason, e.code or -1)

    def allocate_managed_buffer(self, length: int) -> int:
        """Maps ``length`` bytes (page-aligned, zeroed, at least one page), registers them
        and returns the address; 0 on failure."""
        try:
            n = _u(length)
        except _Bad:
            raise _incompatible("allocate_managed_buffer", _SIG["allocate_managed_buffer"], (length,)) from None
        core = self._need("allocate_managed_buffer")
        if core is None:
            return 0
        try:
            return core.allocate_managed(n, "cpu:0")
        except KvferryError as e:
            return _fail("allocate_managed_buffer", e.reason, 0)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Unregisters and unmaps a buffer from :meth:`allocate_managed_buffer`. Returns 0
        (also, as in Mooncake, for an address that is not one: that is logged)."""
        try:
            a, _ = _u(buffer_addr), _u(length)
        except _Bad:
            raise _incompatible("free_managed_buffer", _SIG["free_managed_buffer"], (buffer_addr, length)) from None
        core = self._need("free_managed_buffer")
        if core is None:
            return -1
        native = self._native
        try:
            if native is not None and native._core is core:
                # Views from get_engine().view() keep their buffer mapped: refused while one
                # lives (BufferError); InvalidArgument for an address that is not one.
                native.free_managed_buffer(a)
                freed = True
            else:
                freed = core.free_managed(a)
        except BufferError as e:
            return _fail("free_managed_buffer", str(e), -1)
        except InvalidArgument:
            freed = False
        except KvferryError as e:
            return _fail("free_managed_buffer", e.reason, e.code or -1)
        if not freed:
            _fail("free_managed_buffer", "0x%x is not an address returned by allocate_managed_buffer; nothing freed" % a, 0)
        return 0

    def write_bytes_to_buffer(self, dest_address: int, src_bytes: bytes, length: int) -> int:
        """Copies ``src_bytes[:length]`` to ``dest_address``. Returns 0, or -1 if the range
        is not writable memory of this process (Mooncake would crash)."""
        try:
            a, data, n = _u(dest_address), _data(src_bytes), _u(length)
        except _Bad:
            raise _incompatible("write_bytes_to_buffer", _SIG["write_bytes_to_buffer"], (dest_address, src_bytes, length)) from None
        if n < len(data):
            data = data[:n]
        core = self._core
        try:
            if core is not None and not core.closed:
                core.write_memory(a, data)
            else:
                _kvferry.write_memory(a, data)
            return 0
        except KvferryError as e:
            return _fail("write_bytes_to_buffer", e.reason)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Copies ``length`` bytes from ``source_address``. Returns b"" (reason logged) if the
        range is not readable memory of this process (Mooncake would crash)."""
        try:
            a, n = _u(source_address), _u(length)
        except _Bad:
            raise _incompatible("read_bytes_from_buffer", _SIG["read_bytes_from_buffer"], (source_address, length)) from None
        core = self._core
        try:
            if core is not None and not core.closed:
                return core.read_memory(a, n)
            return _kvferry.read_memory(a, n)
        except KvferryError as e:
            return _fail("read_bytes_from_buffer", e.reason, b"")

    # -- synchronous transfers -----------------------------------------------------------

    def _hints(self, method: str, core: Any, target: str, hints: Tuple[str, str]) -> bool:
        """Checks ``transport_hint``/``nic_hint`` against how this engine reaches ``target``:
        True when they can be met (or are empty); else logs why and returns False. An unknown
        transport name raises ValueError, as Mooncake's."""
        if not hints[0] and not hints[1]:
            return True
        try:
            _kvferry.check_hints(core, target, hints[0], hints[1])
            return True
        except InvalidArgument as e:
            if e.reason.startswith("Unknown transport_hint"):
                raise ValueError(e.reason) from None
            _fail(method, e.reason)
        except KvferryError as e:
            _fail(method, e.reason)
        return False

    def _sync(self, method: str, target: str, locals_: List[int], remotes: List[int], lengths: List[int], op: int, notify: Optional[Tuple[str, str]],
              args: Optional[Tuple[Any, ...]] = None, hints: Tuple[str, str] = ("", "")) -> int:
        core = self._need(method)
        if core is None:
            return -1
        if not self._hints(method, core, target, hints):
            return -1
        try:
            # Timeout: the engine's, plus 1 ns per byte (computed natively).
            core.transfer(target, op, locals_, remotes, lengths)
        except KvferryError as e:
            return _fail(method, e.reason)
        except (TypeError, OverflowError):
            if args is None:
                raise
            self._batch_args(method, args, strict=True)  # raises Mooncake's TypeError
            raise
        if notify is not None:
            try:
                core.send_notify(target, notify[1], notify[0])
            except KvferryError as e:
                _fail(method, "the transfer completed but its notify was not delivered: %s" % e.reason, 0)
        return 0

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "", nic_hint: str = "") -> int:
        """Writes ``length`` bytes from local ``buffer`` to ``peer_buffer_address`` of segment
        ``target_hostname`` (``"host:rpc_port"``); blocks. Returns 0 or -1.

        ``transport_hint`` (every transfer call has it): ``""``/``"unspec"``, or the
        transport this engine uses for the peer (``"tcp"``, ``"shm"`` on one host, ``"rdma"``);
        a transport it cannot use for that peer is -1 with the reason logged, an unknown name
        ValueError. ``nic_hint``: ``""``, or the NIC when the engine uses RDMA through that
        NIC only (start it with ``device_name=<nic>``); otherwise -1 with the reason."""
        try:
            t, b, p, n, th, nh = _s(target_hostname), _u(buffer), _u(peer_buffer_address), _u(length), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible("transfer_sync_write", _SIG["transfer_sync_write"], (target_hostname, buffer, peer_buffer_address, length, transport_hint, nic_hint)) from None
        return self._sync("transfer_sync_write", t, [b], [p], [n], 1, None, hints=(th, nh))

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "", nic_hint: str = "") -> int:
        """Reads ``length`` bytes at ``peer_buffer_address`` of ``target_hostname`` into local
        ``buffer``; blocks. Returns 0 or -1."""
        try:
            t, b, p, n, th, nh = _s(target_hostname), _u(buffer), _u(peer_buffer_address), _u(length), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible("transfer_sync_read", _SIG["transfer_sync_read"], (target_hostname, buffer, peer_buffer_address, length, transport_hint, nic_hint)) from None
        return self._sync("transfer_sync_read", t, [b], [p], [n], 0, None, hints=(th, nh))

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode: TransferOpcode, notify: Optional[TransferNotify] = None, transport_hint: str = "", nic_hint: str = "") -> int:
        """One transfer in direction ``opcode``; after success ``notify`` (if any) is
        delivered to the target. Returns 0 or -1."""
        try:
            t, b, p, n, op, nt, th, nh = _s(target_hostname), _u(buffer), _u(peer_buffer_address), _u(length), _op(opcode), _notify(notify), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible("transfer_sync", _SIG["transfer_sync"], (target_hostname, buffer, peer_buffer_address, length, opcode, notify, transport_hint, nic_hint)) from None
        return self._sync("transfer_sync", t, [b], [p], [n], op, nt, hints=(th, nh))

    def _batch_args(self, method: str, args: Tuple[Any, ...], strict: bool = False) -> Tuple[str, List[int], List[int], List[int]]:
        """Plain lists go to the native call as they are: it checks every item (a non-int or
        out-of-range item raises TypeError/OverflowError there, and the caller re-runs this with
        ``strict`` to raise Mooncake's TypeError); anything else is checked here."""
        try:
            t = _s(args[0])
            if not strict and type(args[1]) is list and type(args[2]) is list and type(args[3]) is list:
                return t, args[1], args[2], args[3]
            return t, _ul(args[1]), _ul(args[2]), _ul(args[3])
        except _Bad:
            raise _incompatible(method, _SIG[method], args) from None

    def _hint_args(self, method: str, args: Tuple[Any, ...], transport_hint: Any, nic_hint: Any) -> Tuple[str, str]:
        if not isinstance(transport_hint, str) or not isinstance(nic_hint, str):
            raise _incompatible(method, _SIG[method], args)
        return transport_hint, nic_hint

    def batch_transfer_sync_write(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "", nic_hint: str = "") -> int:
        """Writes ``lengths[i]`` bytes from ``buffers[i]`` to ``peer_buffer_addresses[i]``, all
        in one batch (adjacent descriptors merged by the engine); blocks. Returns 0 or -1."""
        m = "batch_transfer_sync_write"
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, args)
        hints = self._hint_args(m, args, transport_hint, nic_hint)
        return self._sync(m, t, b, p, n, 1, None, args, hints)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "", nic_hint: str = "") -> int:
        """Reads ``lengths[i]`` bytes at ``peer_buffer_addresses[i]`` into ``buffers[i]``, all
        in one batch; blocks. Returns 0 or -1."""
        m = "batch_transfer_sync_read"
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, args)
        hints = self._hint_args(m, args, transport_hint, nic_hint)
        return self._sync(m, t, b, p, n, 0, None, args, hints)

    def batch_transfer_sync(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], opcode: TransferOpcode, notify: Optional[TransferNotify] = None, transport_hint: str = "", nic_hint: str = "") -> int:
        """One batch in direction ``opcode``, then ``notify`` (if any). Returns 0 or -1."""
        m = "batch_transfer_sync"
        allargs = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, allargs[:4] + (transport_hint,), strict=True)
        try:
            op, nt, th, nh = _op(opcode), _notify(notify), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible(m, _SIG[m], allargs) from None
        return self._sync(m, t, b, p, n, op, nt, hints=(th, nh))

    # -- asynchronous transfers ----------------------------------------------------------

    def _submit(self, method: str, target: str, locals_: List[int], remotes: List[int], lengths: List[int], op: int,
                args: Optional[Tuple[Any, ...]] = None, hints: Tuple[str, str] = ("", "")) -> int:
        core = self._need(method)
        if core is None:
            return 0
        if not self._hints(method, core, target, hints):
            return 0
        try:
            bid = core.submit(target, op, locals_, remotes, lengths, None, True)
        except KvferryError as e:
            return _fail(method, e.reason, 0)
        except (TypeError, OverflowError):
            if args is None:
                raise
            self._batch_args(method, args, strict=True)  # raises Mooncake's TypeError
            raise
        return bid

    def batch_transfer_async_write(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "", nic_hint: str = "") -> int:
        """Submits a WRITE batch and returns its id (0 on failure) at once; complete it with
        :meth:`get_batch_transfer_status` or :meth:`transfer_check_status`."""
        m = "batch_transfer_async_write"
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, args)
        hints = self._hint_args(m, args, transport_hint, nic_hint)
        return self._submit(m, t, b, p, n, 1, args, hints)

    def batch_transfer_async_read(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], transport_hint: str = "", nic_hint: str = "") -> int:
        """Submits a READ batch and returns its id (0 on failure) at once."""
        m = "batch_transfer_async_read"
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, args)
        hints = self._hint_args(m, args, transport_hint, nic_hint)
        return self._submit(m, t, b, p, n, 0, args, hints)

    def batch_transfer_async(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], opcode: TransferOpcode, transport_hint: str = "", nic_hint: str = "") -> int:
        """Submits a batch in direction ``opcode``; returns its id (0 on failure)."""
        m = "batch_transfer_async"
        allargs = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint, nic_hint)
        t, b, p, n = self._batch_args(m, allargs[:4] + (transport_hint,), strict=True)
        try:
            op, th, nh = _op(opcode), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible(m, _SIG[m], allargs) from None
        return self._submit(m, t, b, p, n, op, hints=(th, nh))

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = "", nic_hint: str = "") -> int:
        """Submits one WRITE and returns its batch id (0 on failure); poll it with
        :meth:`transfer_check_status`."""
        try:
            t, b, p, n, th, nh = _s(target_hostname), _u(buffer), _u(peer_buffer_address), _u(length), _s(transport_hint), _s(nic_hint)
        except _Bad:
            raise _incompatible("transfer_submit_write", _SIG["transfer_submit_write"], (target_hostname, buffer, peer_buffer_address, length, transport_hint, nic_hint)) from None
        return self._submit("transfer_submit_write", t, [b], [p], [n], 1, hints=(th, nh))

    def get_batch_transfer_status(self, batch_ids: List[int]) -> int:
        """Waits until every listed batch completed (0) or one failed or timed out (-1); every
        listed batch is freed either way. A batch counts as over only once the engine ended
        every request of it (each ends by its deadline, the transfer timeout plus 1 ns per
        byte): nothing lands in its buffers after this returned."""
        try:
            ids = _ul(batch_ids)
        except _Bad:
            raise _incompatible("get_batch_transfer_status", _SIG["get_batch_transfer_status"], (batch_ids,)) from None
        if not ids:
            return 0
        core = self._need("get_batch_transfer_status")
        if core is None:
            return -1
        ret = 0
        for bid in ids:
            try:
                if ret == 0:
                    # Until every request is over: the engine ends each by its deadline.
                    st, _, reason, _ = core.wait_batch(bid)
                    if st != 4:
                        what = {5: "timed out", 6: "failed", 3: "was canceled"}.get(st, "did not finish")
                        ret = _fail("get_batch_transfer_status", "batch %d %s%s" % (bid, what, ": %s" % reason if reason else ""))
                core.release_batch(bid)
            except KvferryError as e:
                ret = _fail("get_batch_transfer_status", e.reason)
        return ret

    def transfer_check_status(self, batch_id: int) -> int:
        """Non-blocking poll of a batch: 1 completed (freed), 0 in progress, -1 failed
        (freed), -2 timed out (freed). In progress until the engine ended every request (each
        ends by its deadline): nothing lands in its buffers once this said otherwise."""
        try:
            bid = _u(batch_id)
        except _Bad:
            raise _incompatible("transfer_check_status", _SIG["transfer_check_status"], (batch_id,)) from None
        core = self._need("transfer_check_status")
        if core is None:
            return -1
        try:
            st, _, reason, _ = core.batch_status(bid)
            if st in (0, 1):
                return 0
            if st == 4:
                ret = 1
            elif st == 5:
                ret = _fail("transfer_check_status", "batch %d timed out: %s" % (bid, reason), -2)
            else:
                ret = _fail("transfer_check_status", "batch %d failed: %s" % (bid, reason), -1)
            core.release_batch(bid)
            return ret
        except KvferryError as e:
            return _fail("transfer_check_status", e.reason)

    # -- segments, notifies, liveness ----------------------------------------------------

    def get_first_buffer_address(self, segment_name: str) -> int:
        """Opens ``segment_name`` and returns the address of its first registered buffer,
        or 0 (no buffer, or the segment cannot be opened)."""
        try:
            name = _s(segment_name)
        except _Bad:
            raise _incompatible("get_first_buffer_address", _SIG["get_first_buffer_address"], (segment_name,)) from None
        core = self._need("get_first_buffer_address")
        if core is None:
            return 0
        try:
            bufs = core.segment_buffers(name)
        except KvferryError as e:
            return _fail("get_first_buffer_address", e.reason, 0)
        if not bufs:
            return _fail("get_first_buffer_address", "segment %r has no registered buffer" % name, 0)
        return bufs[0][0]

    def get_notifies(self) -> List[TransferNotify]:
        """Drains the notifies received so far."""
        core = self._need("get_notifies")
        if core is None:
            return []
        try:
            return [TransferNotify(n, m) for n, m in core.get_notifies()]
        except KvferryError as e:
            return _fail("get_notifies", e.reason, [])

    def send_probe(self, peer_server_name: str) -> int:
        """Checks that a peer's handshake port answers: 0, else -101 (name cannot be
        resolved) or -102 (cannot connect), as Mooncake."""
        try:
            name = _s(peer_server_name)
        except _Bad:
            raise _incompatible("send_probe", _SIG["send_probe"], (peer_server_name,)) from None
        core = self._need("send_probe")
        if core is None:
            return -1
        name = _with_default_port(name)
        try:
            core.probe(name)
            return 0
        except KvferryError as e:
            return _fail("send_probe", e.reason, e.code or -1)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """EFA pre-connect in Mooncake; a no-op here (returns 0)."""
        try:
            _s(segment_name)
        except _Bad:
            raise _incompatible("warmup_efa_segment", _SIG["warmup_efa_segment"], (segment_name,)) from None
        return 0

    def __repr__(self) -> str:
        core = self._core
        return "<kvferry.mooncake.engine.TransferEngine %s>" % ("uninitialized" if core is None else repr(core))


_NOT_PROVIDED = ("CoroRPCInterface", "RpcInterface", "ReceivedData", "ReceivedTensor", "SharedSegment", "create_rpc_client", "create_rpc_server")


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise AttributeError("mooncake.engine.%s is not provided by kvferry (only the TransferEngine API is)" % name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
