"""Mooncake's stream-ordered ``*_on_cuda`` calls on kvferry (bound, as in Mooncake, only where
``SUPPORT_CUDA`` is true: the CUDA driver is usable for GPU memory and has
``cuStreamSynchronize``).

Each call waits for the work queued on ``stream_ptr`` (``cuStreamSynchronize``; 0: the legacy
default stream), then moves the bytes synchronously (GPU memory staged through pinned host
buffers), so work queued on the stream afterwards sees them. Returns None; a failure raises
RuntimeError with the reason."""

from __future__ import annotations

import ctypes
from typing import Any, Callable, List, Optional

from ._args import _SIG, _Bad, _incompatible, _s, _u, _ul

_SIG.update({
    "transfer_write_on_cuda": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, stream_ptr: int = 0, transport_hint: str = '', nic_hint: str = '') -> None",
    "transfer_read_on_cuda": "target_hostname: str, buffer: int, peer_buffer_address: int, length: int, stream_ptr: int = 0, transport_hint: str = '', nic_hint: str = '') -> None",
    "batch_transfer_write_on_cuda": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], stream_ptr: int = 0, transport_hint: str = '', nic_hint: str = '') -> None",
    "batch_transfer_read_on_cuda": "target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int], stream_ptr: int = 0, transport_hint: str = '', nic_hint: str = '') -> None",
})


def stream_sync() -> Optional[Callable[[Any], int]]:
    """The driver's ``cuStreamSynchronize``, or None where libcuda.so.1 or the symbol is
    missing (then SUPPORT_CUDA is False and the ``*_on_cuda`` calls are not bound)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuStreamSynchronize
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


#: Set by kvferry.mooncake.engine where SUPPORT_CUDA holds.
_SYNC: Optional[Callable[[Any], int]] = None


class _OnCuda:
    """The ``*_on_cuda`` calls; mixed into TransferEngine only where SUPPORT_CUDA holds."""

    _sync: Any

    def _on_cuda(self, method: str, args: tuple, locals_: Any, remotes: Any, lengths: Any, op: int) -> None:
        try:
            t, stream, th, nh = _s(args[0]), _u(args[4]), _s(args[5]), _s(args[6])
            ls, rs, ns = _ul(locals_), _ul(remotes), _ul(lengths)
        except _Bad:
            raise _incompatible(method, _SIG[method], args) from None
        sync = _SYNC
        if sync is None:
            raise RuntimeError("%s: the CUDA driver has no cuStreamSynchronize" % method)
        rc = sync(ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError("%s: cuStreamSynchronize(0x%x) failed with CUDA error %d; nothing was moved" % (method, stream, rc))
        if self._sync(method, t, ls, rs, ns, op, None, hints=(th, nh)) != 0:
            raise RuntimeError("%s to %s failed (the reason is logged by the logger \"kvferry\")" % (method, t))

    def transfer_write_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, stream_ptr: int = 0, transport_hint: str = "", nic_hint: str = "") -> None:
        """Writes ``length`` bytes after the work queued on ``stream_ptr``; see the module."""
        args = (target_hostname, buffer, peer_buffer_address, length, stream_ptr, transport_hint, nic_hint)
        self._on_cuda("transfer_write_on_cuda", args, [buffer], [peer_buffer_address], [length], 1)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, stream_ptr: int = 0, transport_hint: str = "", nic_hint: str = "") -> None:
        """Reads ``length`` bytes after the work queued on ``stream_ptr``."""
        args = (target_hostname, buffer, peer_buffer_address, length, stream_ptr, transport_hint, nic_hint)
        self._on_cuda("transfer_read_on_cuda", args, [buffer], [peer_buffer_address], [length], 0)

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], stream_ptr: int = 0, transport_hint: str = "", nic_hint: str = "") -> None:
        """Writes a batch after the work queued on ``stream_ptr``."""
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr, transport_hint, nic_hint)
        self._on_cuda("batch_transfer_write_on_cuda", args, buffers, peer_buffer_addresses, lengths, 1)

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int], lengths: List[int], stream_ptr: int = 0, transport_hint: str = "", nic_hint: str = "") -> None:
        """Reads a batch after the work queued on ``stream_ptr``."""
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr, transport_hint, nic_hint)
        self._on_cuda("batch_transfer_read_on_cuda", args, buffers, peer_buffer_addresses, lengths, 0)
