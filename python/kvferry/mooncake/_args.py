"""Argument checking of ``kvferry.mooncake.engine``, pybind11 style: Mooncake's TypeError
for arguments of the wrong type, its signatures, and the failure log."""

from __future__ import annotations

import logging
import operator
import sys
from typing import Any, List, Optional, Sequence, Tuple

log = logging.getLogger("kvferry")

_U64 = 1 << 64

# -- argument checking, pybind11 style ------------------------------------------------------

class _Bad(Exception):
    pass


def _u(v: Any) -> int:
    if isinstance(v, float):
        raise _Bad
    try:
        i = operator.index(v)
    except TypeError:
        raise _Bad from None
    if i < 0 or i >= _U64:
        raise _Bad
    return i


def _ul(v: Any) -> List[int]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise _Bad
    try:
        items = list(v)
    except TypeError:
        raise _Bad from None
    if all(type(x) is int and 0 <= x < _U64 for x in items):
        return items
    return [_u(x) for x in items]


def _s(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    raise _Bad


def _opt_s(v: Any) -> Optional[str]:
    return None if v is None else _s(v)


def _data(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape")
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    raise _Bad


def _seq(v: Any) -> List[Any]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise _Bad
    try:
        return list(v)
    except TypeError:
        raise _Bad from None


# Buffer formats of 8-byte integers (struct codes; numpy int64 is "l", uint64 "L"), and
# whether they are signed. A leading "@" or "=" is native order; "<" is native here only on
# little-endian hosts.
_INT8 = {"q": True, "l": True, "n": True, "Q": False, "L": False, "N": False}
_NATIVE = ("@", "=", "<") if sys.byteorder == "little" else ("@", "=", ">", "!")


def _array(v: Any, name: str, method: str, args: Tuple[Any, ...], rows: int = 0) -> Tuple[bytes, bool]:
    """An array argument of the 0.3.14 calls as (its bytes, signed): one-dimensional (or,
    with ``rows``, ``[F, rows]`` and C-contiguous), contiguous, of 8-byte integers. O(1)
    Python work: the items are read and checked in native code. A non-buffer raises
    Mooncake's TypeError (incompatible arguments); a buffer of the wrong shape, item type or
    layout, TypeError naming it, as Mooncake 0.3.14."""
    if isinstance(v, str):
        raise _incompatible(method, _SIG[method], args)
    try:
        mv = memoryview(v)
    except TypeError:
        raise _incompatible(method, _SIG[method], args) from None
    with mv:
        fmt = mv.format
        if fmt[:1] in _NATIVE:
            fmt = fmt[1:]
        if rows:
            if mv.ndim != 2 or mv.shape[1] != rows:
                raise TypeError("%s must be a [rows, %d] array (got shape %s)" % (name, rows, tuple(mv.shape)))
        elif mv.ndim != 1:
            raise TypeError("%s must be a one-dimensional array (got %d dimensions)" % (name, mv.ndim))
        if mv.itemsize != 8 or fmt not in _INT8:
            raise TypeError("%s must hold 8-byte integers (uint64/int64), not format %r" % (name, mv.format))
        if rows and not mv.c_contiguous:
            raise TypeError("%s must be C-contiguous" % name)
        if not mv.contiguous:
            raise TypeError("%s must be contiguous" % name)
        return mv.tobytes(), _INT8[fmt]


def _incompatible(method: str, signature: str, args: Sequence[Any]) -> TypeError:
    return TypeError(
        "%s(): incompatible function arguments. The following argument types are supported:\n"
        "    1. (self: kvferry.mooncake.engine.TransferEngine, %s)\n\nInvoked with: %s"
        % (method, signature, ", ".join(repr(a) for a in args))
    )


_SIG = {
    "initialize": "local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int",
    "initialize_ext": "local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str) -> int",
    "register_memory": "buffer_addr: int, capacity: int, location: str = '*', remote_accessible: bool = True) -> int",
    "unregister_memory": "buffer_addr: int) -> int",
    "batch_register_memory": "buffer_addresses: list[int], capacities: list[int], location: str = '*') -> int",
    "batch_unregister_memory": "buffer_addresses: list[int]) -> int",
    "allocate_managed_buffer": "length: int) -> int",
    "free_managed_buffer": "buffer_addr: int, length: int) -> int",
    "write_bytes_to_buffer": "dest_address: int, src_bytes: bytes, length: int) -> int",
    "read_bytes_from_buffer": "source_address: int, length: int) -> bytes",
    "transfer_sync_write": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = '', nic_hint: str = '') -> int",
    "transfer_sync_read": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = '', nic_hint: str = '') -> int",
    "transfer_sync": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode: TransferOpcode, notify: TransferNotify = None, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync_write": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync_read": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], opcode: TransferOpcode, notify: TransferNotify = None, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_async_write": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_async_read": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_async": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], opcode: TransferOpcode, transport_hint: str = '', nic_hint: str = '') -> int",
    "get_batch_transfer_status": "batch_ids: list[int]) -> int",
    "batch_transfer_sync_write_arrays": "target_hostname: str, buffers: Buffer, peer_buffer_addresses: Buffer, lengths: Buffer, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync_read_arrays": "target_hostname: str, buffers: Buffer, peer_buffer_addresses: Buffer, lengths: Buffer, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_async_write_arrays": "target_hostname: str, buffers: Buffer, peer_buffer_addresses: Buffer, lengths: Buffer, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_async_read_arrays": "target_hostname: str, buffers: Buffer, peer_buffer_addresses: Buffer, lengths: Buffer, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync_write_pages": "target_hostname: str, src_pages: Buffer, dst_pages: Buffer, fields: Buffer, max_batch_size: int = 0, transport_hint: str = '', nic_hint: str = '') -> int",
    "batch_transfer_sync_read_pages": "target_hostname: str, src_pages: Buffer, dst_pages: Buffer, fields: Buffer, max_batch_size: int = 0, transport_hint: str = '', nic_hint: str = '') -> int",
    "submit_scatter_write": "endpoint: str, local_base_addresses: list[int], local_capacities: list[int], remote_base_addresses: list[int], remote_capacities: list[int], local_offsets: list[list[int]], remote_offsets: list[list[int]], lengths: list[list[int]]) -> ScatterTransferTicket",
    "submit_scatter_read": "endpoint: str, local_base_addresses: list[int], local_capacities: list[int], remote_base_addresses: list[int], remote_capacities: list[int], local_offsets: list[list[int]], remote_offsets: list[list[int]], lengths: list[list[int]]) -> ScatterTransferTicket",
    "scatter_transfer_sync_write_with_ticket": "endpoint: str, local_base_addresses: list[int], local_capacities: list[int], remote_base_addresses: list[int], remote_capacities: list[int], local_offsets: list[list[int]], remote_offsets: list[list[int]], lengths: list[list[int]]) -> ScatterTransferTicket",
    "scatter_transfer_sync_read_with_ticket": "endpoint: str, local_base_addresses: list[int], local_capacities: list[int], remote_base_addresses: list[int], remote_capacities: list[int], local_offsets: list[list[int]], remote_offsets: list[list[int]], lengths: list[list[int]]) -> ScatterTransferTicket",
    "transfer_submit_write": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = '', nic_hint: str = '') -> int",
    "transfer_check_status": "batch_id: int) -> int",
    "get_first_buffer_address": "segment_name: str) -> int",
    "get_local_topology": "device_name: str = None) -> str",
    "send_probe": "peer_server_name: str) -> int",
    "warmup_efa_segment": "segment_name: str) -> int",
}


_warned: set = set()


def _warn_once(msg: str) -> None:
    key = msg.split(":", 1)[0]
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", msg)


def _fail(method: str, reason: str, ret: Any = -1) -> Any:
    """Logs one failure (once) and returns ``ret``."""
    log.warning("%s failed: %s", method, reason)
    return ret


_NOT_INITIALIZED = "TransferEngine.initialize() has not been called (or failed)"
