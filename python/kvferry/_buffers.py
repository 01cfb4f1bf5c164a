"""Turning Python buffers into (address, size) pairs for the native API.

Accepted: plain integer addresses, and objects exposing writable C-contiguous host memory:
``bytearray``, writable ``memoryview``, ``mmap.mmap``, ``array.array``, numpy arrays
(``__array_interface__``), ctypes arrays, and CPU torch tensors (``data_ptr()``).
Read-only buffers (``bytes``) are refused: a peer may write into registered memory, and
READ transfers write into the local buffer.

Pinning (what the returned ``keepalive`` guarantees while the engine holds it):

- objects with the buffer protocol (``bytearray``, ``memoryview``, ``mmap``, ``array``, numpy
  arrays, ctypes arrays): ``keepalive`` holds a buffer export, so the memory stays allocated
  and the exporter refuses to move it (``bytearray`` resize, ``numpy.ndarray.resize`` and
  ``mmap.resize``/``close`` raise ``BufferError`` meanwhile);
- CPU torch tensors (no buffer protocol): ``keepalive`` holds the tensor and its storage, so
  the memory stays allocated even if the tensor is deleted or ``set_()`` to other storage;
  torch cannot refuse ``resize_()`` to a larger size, which reallocates the storage: do not
  resize a tensor while it is registered or in flight;
- other ``__array_interface__`` objects: only the object itself is held (whatever keeps its
  memory alive is up to it).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any, Optional, Tuple

from ._errors import InvalidArgument

_U64 = 1 << 64


def as_u64(value: Any, what: str) -> int:
    """An integer in [0, 2**64) or InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidArgument("%s must be an integer, not bool" % what, -1)
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument("%s must be an integer, not %s" % (what, type(value).__name__), -1) from None
    if v < 0:
        raise InvalidArgument("%s must be >= 0, got %d" % (what, v), -1)
    if v >= _U64:
        raise InvalidArgument("%s must be < 2**64, got %d" % (what, v), -1)
    return v


def _itemsize(typestr: str) -> int:
    digits = "".join(ch for ch in typestr if ch.isdigit())
    if not digits:
        raise InvalidArgument("unsupported __array_interface__ typestr %r" % (typestr,), -1)
    return int(digits)


def _from_array_interface(obj: Any, ai: dict) -> Tuple[int, int, Any]:
    data = ai.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise InvalidArgument("%s exposes no data pointer in __array_interface__" % type(obj).__name__, -1)
    ptr, readonly = data
    if readonly:
        raise InvalidArgument("%s is read-only; pass a writable array" % type(obj).__name__, -1)
    shape = tuple(ai.get("shape", ()))
    itemsize = _itemsize(ai.get("typestr", ""))
    strides = ai.get("strides")
    if strides is not None:
        expected = itemsize
        for dim, stride in zip(reversed(shape), reversed(tuple(strides))):
            if dim > 1 and stride != expected:
                raise InvalidArgument(
                    "%s is not C-contiguous; pass a contiguous array (e.g. numpy.ascontiguousarray)" % type(obj).__name__,
                    -1,
                )
            expected *= dim
    n = itemsize
    for dim in shape:
        n *= dim
    return int(ptr or 0), n, obj


def _from_torch(obj: Any) -> Tuple[int, int, Any]:
    # The storage object owns the memory: holding it keeps the bytes allocated even if the
    # tensor is deleted or set_() to another storage.
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", "cpu") if device is not None else "cpu"
    if kind == "cuda":
        from . import _kvferry

        if not _kvferry.features()["cuda"]:
            raise InvalidArgument(
                "tensor is on %s, but the CUDA driver is not usable by kvferry here (kvferry.features()['cuda'] is False; `kvferry doctor` says why)" % (device,),
                -1,
            )
    elif kind != "cpu":
        raise InvalidArgument("tensor is on %s; kvferry moves host and CUDA memory only" % (device,), -1)
    if not obj.is_contiguous():
        raise InvalidArgument("tensor is not contiguous; call .contiguous() first", -1)
    storage = None
    get_storage = getattr(obj, "untyped_storage", None) or getattr(obj, "storage", None)
    if callable(get_storage):
        try:
            storage = get_storage()
        except Exception:  # pragma: no cover - exotic tensor subclasses
            storage = None
    return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), (obj, storage)


def resolve(obj: Any, length: Optional[int] = None, what: str = "buffer") -> Tuple[int, int, Any]:
    """Returns (address, length, keepalive).

    ``obj`` is an integer address (then ``length`` is required) or a writable contiguous
    buffer (then ``length`` defaults to its size and may not exceed it). ``keepalive`` must
    stay referenced while the memory is in use; for buffers it pins the export, so e.g. a
    bytearray cannot be resized meanwhile.
    """
    if isinstance(obj, int) and not isinstance(obj, bool):
        addr = as_u64(obj, what)
        if length is None:
            raise InvalidArgument("%s is an integer address: pass its length too" % what, -1)
        return addr, as_u64(length, "length"), None
    try:
        # The buffer protocol first (numpy arrays have it too): its export is a real pin.
        view: Optional[memoryview] = memoryview(obj)
        if view is not None and view.nbytes and view.c_contiguous and not view.readonly and (view.format != "B" or view.ndim != 1):
            view.cast("B")  # formats the struct module does not know cannot be flattened
    except (TypeError, ValueError, BufferError, NotImplementedError):
        view = None
    ai = getattr(obj, "__array_interface__", None) if view is None else None
    if isinstance(ai, dict):
        addr, size, keep = _from_array_interface(obj, ai)
    elif view is None and callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "element_size", None)):
        addr, size, keep = _from_torch(obj)
    else:
        if view is None:
            raise InvalidArgument(
                "%s must be an integer address or a writable buffer (bytearray, memoryview, numpy array, mmap), not %s"
                % (what, type(obj).__name__),
                -1,
            )
        if view.readonly:
            raise InvalidArgument("%s (%s) is read-only; pass a writable buffer such as a bytearray" % (what, type(obj).__name__), -1)
        if not view.c_contiguous:
            raise InvalidArgument("%s (%s) is not C-contiguous" % (what, type(obj).__name__), -1)
        size = view.nbytes
        if size == 0:
            addr, keep = 0, view
        else:
            flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            anchor = (ctypes.c_char * size).from_buffer(flat)
            addr, keep = ctypes.addressof(anchor), anchor
    if length is None:
        return addr, size, keep
    n = as_u64(length, "length")
    if n > size:
        raise InvalidArgument("length %d exceeds the %d bytes of %s" % (n, size, what), -1)
    return addr, n, keep


def address(obj: Any, what: str = "address") -> Tuple[int, Any]:
    """An address from an integer or a buffer (its start); returns (address, keepalive)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return as_u64(obj, what), None
    addr, _, keep = resolve(obj, None, what)
    return addr, keep
