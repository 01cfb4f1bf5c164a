"""Mooncake 0.3.14's torch tensor helpers of ``MooncakeDistributedStore`` on kvferry.

A tensor is stored as one object in Mooncake's tensor object format, so a value written by
stock Mooncake reads back here and the other way round (tests/python/test_tensor.py checks
the bytes against the stock 0.3.14 wheel)::

    [304-byte header][the tensor's bytes, C order]

The header, little-endian, fields at their C struct offsets (``TensorMetadata`` of
Mooncake's ``integration_utils.h``):

    0   u32 magic 0x4D4F4F4E     4  u16 version 1     6  u16 header_size 304
    8   i32 dtype (table below)  12 i32 ndim (<= 8)   16 u32 layout_kind (0 full, 1 shard)
    20  u32 flags 0              24 u64 data_offset (304)  32 u64 data_bytes
    40  i64[8] global shape      104 i64[8] local shape (unused dims -1)
    168 u32 axis_count (<= 4)    172 u32 0
    176 4 x {i32 kind (DP 0, TP 1, EP 2, PP 3), i32 axis_index, i32 shard_rank,
             i32 shard_count, i32 split_dim, i32 reserved, i64 local extent of split_dim}

``put_tensor_with_tp(key, t, tp_size=n, split_dim=d)`` stores ``n`` shards (``d`` must divide
evenly) as ``key_tp_0`` .. ``key_tp_{n-1}``, each a SHARD object with one TP axis;
``get_tensor_with_tp(key, tp_rank=r, tp_size=n)`` reads ``key_tp_r``.

The methods are those of :class:`TensorMethods`, a base of ``MooncakeDistributedStore``; they
write and read through the store's own calls (``put_parts``/``upsert_parts``, ``get_buffer``,
``put_from``/``get_into``...), so every store feature (replication config, leases, the
shared engine) applies. torch is imported on first use; without it these calls raise
ImportError naming it (Mooncake's do the same). CUDA tensors are copied to host memory first
(``.cpu()``); ``get_tensor_into_cuda`` (CUDA IPC through a dummy client) is refused.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

_log = logging.getLogger("kvferry")

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
FILE_NOT_FOUND = -1100  # Mooncake's ErrorCode::FILE_NOT_FOUND

MAGIC = 0x4D4F4F4E
VERSION = 1
HEADER_SIZE = 304
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1
AXIS_TP = 1

_HEAD = struct.Struct("<IHHiiIIQQ")  # 40 bytes
_SHAPE = struct.Struct("<8q")  # 64 bytes
_COUNT = struct.Struct("<II")  # 8 bytes
_AXIS = struct.Struct("<iiiiiiq")  # 32 bytes
assert _HEAD.size + 2 * _SHAPE.size + _COUNT.size + MAX_AXES * _AXIS.size == HEADER_SIZE

# Mooncake's TensorDtype codes: torch dtype name -> (code, element size).
_DTYPES = {
    "float32": (0, 4), "float64": (1, 8), "int8": (2, 1), "uint8": (3, 1), "int16": (4, 2),
    "uint16": (5, 2), "int32": (6, 4), "uint32": (7, 4), "int64": (8, 8), "uint64": (9, 8),
    "bool": (10, 1), "float16": (11, 2), "bfloat16": (12, 2), "float8_e4m3fn": (13, 1),
    "float8_e5m2": (14, 1),
}
_BY_CODE = {code: (name, size) for name, (code, size) in _DTYPES.items()}


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError("Mooncake's tensor calls need torch (pip install torch): %s" % e) from e
    return torch


def _warn(msg: str) -> None:
    _log.warning("kvferry store: %s", msg)


class Parsed(NamedTuple):
    dtype: int
    local_shape: Tuple[int, ...]
    layout_kind: int
    data_offset: int
    data_bytes: int


def _shape_field(dims: Sequence[int]) -> bytes:
    return _SHAPE.pack(*(list(dims) + [-1] * (MAX_DIMS - len(dims))))


def header(dtype: int, global_shape: Sequence[int], local_shape: Sequence[int], data_bytes: int,
           layout_kind: int = FULL, axes: Sequence[Tuple[int, int, int, int, int, int, int]] = ()) -> bytes:
    """The 304-byte header of a tensor object (see the module docstring)."""
    out = [
        _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, dtype, len(global_shape), layout_kind, 0, HEADER_SIZE, data_bytes),
        _shape_field(global_shape),
        _shape_field(local_shape),
        _COUNT.pack(len(axes), 0),
    ]
    out += [_AXIS.pack(*a) for a in axes]
    out.append(bytes(_AXIS.size * (MAX_AXES - len(axes))))
    return b"".join(out)


def parse(buf: Any, total: int) -> Optional[Parsed]:
    """The header at the start of ``buf`` (a bytes-like object of at least 304 bytes) checked
    as Mooncake checks it against an object of ``total`` bytes; None if it is not valid."""
    if total < HEADER_SIZE:
        return None
    mv = memoryview(buf).cast("B")[:HEADER_SIZE]
    magic, version, hsize, dtype, ndim, kind, _flags, off, nbytes = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or hsize != HEADER_SIZE or dtype not in _BY_CODE:
        return None
    if not 0 <= ndim <= MAX_DIMS or kind > SHARD:
        return None
    gshape = _SHAPE.unpack_from(mv, 40)
    lshape = _SHAPE.unpack_from(mv, 104)
    count, _ = _COUNT.unpack_from(mv, 168)
    if count > MAX_AXES or off < HEADER_SIZE or off > total or nbytes != total - off:
        return None
    if any(d < 0 for d in gshape[:ndim] + lshape[:ndim]):
        return None
    if any(d != -1 for d in gshape[ndim:] + lshape[ndim:]):
        return None
    expect = _BY_CODE[dtype][1]
    for d in lshape[:ndim]:
        expect *= d
    if expect != nbytes:
        return None
    for i in range(count):
        akind, _idx, rank, n, split, _r0, _r1 = _AXIS.unpack_from(mv, 176 + i * _AXIS.size)
        if not 0 <= akind <= 4 or n <= 0 or not 0 <= rank < n or not -1 <= split < ndim:
            return None
    return Parsed(dtype, tuple(lshape[:ndim]), kind, off, nbytes)


class _Info(NamedTuple):
    header: bytes
    ptr: int
    nbytes: int
    owner: Any  # the contiguous host tensor the bytes belong to (kept alive while in use)


def _info(tensor: Any, key: str = "", shard_of: Any = None, axis: Optional[Tuple[int, ...]] = None) -> Optional[_Info]:
    """Header and bytes of a torch tensor (a contiguous host copy when needed), or None
    (logged) for something Mooncake cannot store: not a tensor, an unsupported dtype, more
    than 8 dimensions."""
    where = " for %s" % key if key else ""
    if "Tensor" not in type(tensor).__name__:
        _warn("input%s is not a PyTorch tensor" % where)
        return None
    try:
        t = tensor.contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        name = str(t.dtype).replace("torch.", "")
        if name not in _DTYPES:
            _warn("unsupported tensor dtype %s%s" % (t.dtype, where))
            return None
        if t.dim() > MAX_DIMS:
            _warn("tensor%s has %d dimensions; Mooncake's tensor format holds at most %d" % (where, t.dim(), MAX_DIMS))
            return None
        code, size = _DTYPES[name]
        nbytes = t.numel() * size
        local = list(t.shape)
        if shard_of is None:
            head = header(code, local, local, nbytes)
        else:
            head = header(code, list(shard_of.shape), local, nbytes, SHARD, [axis])  # type: ignore[list-item]
        return _Info(head, t.data_ptr(), nbytes, t)
    except Exception as e:  # noqa: BLE001 - Mooncake logs and refuses
        _warn("cannot read tensor%s: %s" % (where, e))
        return None


def _view(ptr: int, n: int) -> Any:
    """The ``n`` bytes at host address ``ptr`` as a writable memoryview (no copy)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def _tensor(buf: Any, total: int) -> Any:
    """The tensor an object of ``total`` bytes at the start of ``buf`` holds, sharing
    ``buf``'s memory (as Mooncake's does), or None (logged) if it is not a valid object."""
    torch = _torch()
    p = parse(buf, total)
    if p is None:
        _warn("invalid tensor metadata")
        return None
    name, size = _BY_CODE[p.dtype]
    dtype = getattr(torch, name)
    if p.data_bytes == 0:
        return torch.empty(p.local_shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=p.data_bytes // size, offset=p.data_offset)
    # A 0-dim tensor comes back 1-dim (one element), as from Mooncake.
    return t.reshape(p.local_shape) if p.local_shape else t


def serialize_tensor(tensor: Any) -> Tuple[bytes, int, int, Any]:
    """Mooncake's ``mooncake.store._serialize_tensor``: (header, data pointer, data bytes,
    the contiguous tensor owning the data); ValueError for what cannot be stored."""
    info = _info(tensor)
    if info is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    return info.header, info.ptr, info.nbytes, info.owner


def tensor_metadata_size() -> int:
    """Mooncake's ``mooncake.store._tensor_metadata_size``: 304."""
    return HEADER_SIZE


def deserialize_tensor(payload: bytes) -> Any:
    """Mooncake's ``mooncake.store._deserialize_tensor``: the tensor of a whole object
    (header and bytes); ValueError if it is not one."""
    buf = bytearray(payload)
    t = _tensor(buf, len(buf)) if len(buf) >= HEADER_SIZE else None
    if t is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return t


def _tp_key(key: str, rank: int) -> str:
    return "%s_tp_%d" % (key, rank)


def _tp_shards(tensor: Any, key: str, tp_size: int, split_dim: int) -> Optional[List[_Info]]:
    """The ``tp_size`` shards of ``tensor`` along ``split_dim`` (which must divide evenly),
    each with its SHARD header, or None (logged)."""
    if "Tensor" not in type(tensor).__name__:
        _warn("input for %s is not a PyTorch tensor" % key)
        return None
    shape = list(tensor.shape)
    if tp_size <= 0 or not 0 <= split_dim < len(shape):
        _warn("put_tensor_with_tp %s: invalid shard parameters (tp_size=%d, split_dim=%d, %d dims)" % (key, tp_size, split_dim, len(shape)))
        return None
    if shape[split_dim] % tp_size != 0:
        _warn("put_tensor_with_tp %s: only uniform sharding is supported (dim %d of size %d over %d ranks)" % (key, split_dim, shape[split_dim], tp_size))
        return None
    step = shape[split_dim] // tp_size
    out = []
    for rank in range(tp_size):
        chunk = tensor.narrow(split_dim, rank * step, step).contiguous()
        info = _info(chunk, _tp_key(key, rank), tensor, (AXIS_TP, 0, rank, tp_size, split_dim, 0, step))
        if info is None:
            return None
        out.append(info)
    return out


class TensorMethods:
    """The tensor calls of Mooncake 0.3.14's ``MooncakeDistributedStore`` (a base class of
    kvferry's); return codes and None results as Mooncake's (-600 for bad input or a store
    not set up; the reason is logged)."""

    # What the store class provides (kept here so the mixin reads on its own).
    _s: Any

    def _tensor_ready(self, call: str) -> bool:
        if getattr(self, "_s", None) is None:
            _warn("%s: the store is not set up (call setup() first)" % call)
            return False
        return True

    # -- writes ---------------------------------------------------------------------------

    def _write(self, key: str, info: Optional[_Info], config: Any, upsert: bool) -> int:
        if info is None:
            return INVALID_PARAMS
        data = _view(info.ptr, info.nbytes) if info.nbytes else b""
        write = self.upsert_parts if upsert else self.put_parts  # type: ignore[attr-defined]
        return write(key, info.header, data, config=config)

    def _write_many(self, keys: Sequence[str], infos: Sequence[Optional[_Info]], config: Any, upsert: bool) -> List[int]:
        return [self._write(k, i, config, upsert) for k, i in zip(keys, infos)]

    def _check_batch(self, call: str, keys: Sequence[str], items: Sequence[Any], config: Any = None) -> Optional[List[int]]:
        """The all -600 answer of a batch Mooncake refuses as a whole, or None."""
        if not self._tensor_ready(call) or len(keys) != len(items) or not keys:
            if keys and len(keys) != len(items):
                _warn("%s: keys and tensors differ in length" % call)
            return [INVALID_PARAMS] * len(keys)
        if config is not None and _bad_config(config):
            return [INVALID_PARAMS] * len(keys)
        return None

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Stores a torch tensor (0, or a negative error number)."""
        if not self._tensor_ready("put_tensor"):
            return INVALID_PARAMS
        return self._write(key, _info(tensor, key), None, False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Stores a torch tensor, replacing the value of an existing key."""
        if not self._tensor_ready("upsert_tensor"):
            return INVALID_PARAMS
        return self._write(key, _info(tensor, key), None, True)

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """put_tensor with a ReplicateConfig."""
        if not self._tensor_ready("pub_tensor"):
            return INVALID_PARAMS
        if config is not None and _bad_config(config):
            return INVALID_PARAMS
        return self._write(key, _info(tensor, key), config, False)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """upsert_tensor with a ReplicateConfig."""
        if not self._tensor_ready("upsert_pub_tensor"):
            return INVALID_PARAMS
        if config is not None and _bad_config(config):
            return INVALID_PARAMS
        return self._write(key, _info(tensor, key), config, True)

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> List[int]:
        bad = self._check_batch("batch_put_tensor", keys, tensors_list)
        return bad if bad is not None else self._write_many(keys, [_info(t, k) for k, t in zip(keys, tensors_list)], None, False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> List[int]:
        bad = self._check_batch("batch_upsert_tensor", keys, tensors_list)
        return bad if bad is not None else self._write_many(keys, [_info(t, k) for k, t in zip(keys, tensors_list)], None, True)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any], config: Any = None) -> List[int]:
        bad = self._check_batch("batch_pub_tensor", keys, tensors_list, config)
        return bad if bad is not None else self._write_many(keys, [_info(t, k) for k, t in zip(keys, tensors_list)], config, False)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any], config: Any = None) -> List[int]:
        bad = self._check_batch("batch_upsert_pub_tensor", keys, tensors_list, config)
        return bad if bad is not None else self._write_many(keys, [_info(t, k) for k, t in zip(keys, tensors_list)], config, True)

    # -- tensor parallelism ---------------------------------------------------------------

    def _put_tp(self, key: str, tensor: Any, config: Any, tp_size: int, split_dim: int) -> int:
        shards = _tp_shards(tensor, key, tp_size, split_dim)
        if shards is None:
            return INVALID_PARAMS
        for rc in self._write_many([_tp_key(key, r) for r in range(tp_size)], shards, config, False):
            if rc != 0:
                return rc
        return 0

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """Stores the ``tp_size`` shards of ``tensor`` along ``split_dim`` as ``key_tp_<rank>``
        (all of them, whatever ``tp_rank``, as Mooncake); ``tp_size`` 1 is put_tensor."""
        if not self._tensor_ready("put_tensor_with_tp"):
            return INVALID_PARAMS
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._put_tp(key, tensor, None, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Any = None, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        if not self._tensor_ready("pub_tensor_with_tp"):
            return INVALID_PARAMS
        if config is not None and _bad_config(config):
            return INVALID_PARAMS
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._put_tp(key, tensor, config, tp_size, split_dim)

    def _batch_put_tp(self, call: str, keys: Sequence[str], tensors: Sequence[Any], config: Any, tp_size: int, split_dim: int) -> List[int]:
        bad = self._check_batch(call, keys, tensors, config)
        if bad is not None:
            return bad
        out = []
        for k, t in zip(keys, tensors):
            out.append(INVALID_PARAMS if t is None else self._put_tp(k, t, config, tp_size, split_dim))
        return out

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any], tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> List[int]:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._batch_put_tp("batch_put_tensor_with_tp", base_keys, tensors_list, None, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any], config: Any = None, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> List[int]:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._batch_put_tp("batch_pub_tensor_with_tp", base_keys, tensors_list, config, tp_size, split_dim)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        """The shard ``key_tp_<tp_rank>`` (``tp_size`` 1: the tensor ``key``), or None."""
        return self.get_tensor(key if tp_size <= 1 else _tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0, tp_size: int = 1) -> List[Any]:
        return self.batch_get_tensor(list(base_keys) if tp_size <= 1 else [_tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        if not self._tensor_ready("get_tensor_with_tp_into"):
            return None
        return self.get_tensor_into(key if tp_size <= 1 else _tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1) -> List[Any]:
        if not self._tensor_ready("batch_get_tensor_with_tp_into"):
            return [None] * len(base_keys)
        keys = list(base_keys) if tp_size <= 1 else [_tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """Shards the tensor object at ``buffer_ptr`` (header and bytes) as
        put_tensor_with_tp does; ``tp_size`` 1 is put_tensor_from."""
        if not self._tensor_ready("put_tensor_with_tp_from"):
            return INVALID_PARAMS
        if not buffer_ptr or size < HEADER_SIZE:
            _warn("put_tensor_with_tp_from %s: null buffer or fewer than %d bytes" % (key, HEADER_SIZE))
            return INVALID_PARAMS
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        t = _tensor(_view(buffer_ptr, size), size)
        return INVALID_PARAMS if t is None else self._put_tp(key, t, None, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> List[int]:
        if not self._tensor_ready("batch_put_tensor_with_tp_from"):
            return [INVALID_PARAMS] * len(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not base_keys or len(base_keys) != len(buffer_ptrs) or len(base_keys) != len(sizes):
            return [INVALID_PARAMS] * len(base_keys)
        out = []
        for k, p, n in zip(base_keys, buffer_ptrs, sizes):
            t = _tensor(_view(p, n), n) if p and n >= HEADER_SIZE else None
            out.append(INVALID_PARAMS if t is None else self._put_tp(k, t, None, tp_size, split_dim))
        return out

    # -- zero-copy writes of ready-made objects ([header][bytes] in registered memory) ------

    def _from(self, call: str, key: str, buffer_ptr: int, size: int, upsert: bool) -> int:
        if not buffer_ptr:
            _warn("%s %s: buffer pointer cannot be null" % (call, key))
            return INVALID_PARAMS
        if not self._tensor_ready(call):
            return INVALID_PARAMS
        if size < HEADER_SIZE or parse(_view(buffer_ptr, HEADER_SIZE), size) is None:
            _warn("%s %s: the buffer does not start with a valid tensor header for %d bytes" % (call, key, size))
            return INVALID_PARAMS
        write = self.upsert_from if upsert else self.put_from  # type: ignore[attr-defined]
        return write(key, buffer_ptr, size)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Stores the tensor object (``[header][bytes]``, as get_tensor_into leaves it) at
        ``buffer_ptr``: put_from after checking the header."""
        return self._from("put_tensor_from", key, buffer_ptr, size, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._from("upsert_tensor_from", key, buffer_ptr, size, True)

    def _batch_from(self, call: str, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], upsert: bool) -> List[int]:
        if not self._tensor_ready(call):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            _warn("%s: keys, buffer_ptrs and sizes differ in length" % call)
            return [INVALID_PARAMS] * len(keys)
        for i, (p, n) in enumerate(zip(ptrs, sizes)):
            if not p or n < HEADER_SIZE or parse(_view(p, HEADER_SIZE), n) is None:
                _warn("%s: buffer %d is null or does not hold a valid tensor object" % (call, i))
                return [INVALID_PARAMS] * len(keys)
        write = self.batch_upsert_from if upsert else self.batch_put_from  # type: ignore[attr-defined]
        return write(keys, ptrs, sizes)

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        return self._batch_from("batch_put_tensor_from", keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        return self._batch_from("batch_upsert_tensor_from", keys, buffer_ptrs, sizes, True)

    # -- reads ----------------------------------------------------------------------------

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (a host tensor owning a copy), or None."""
        if not self._tensor_ready("get_tensor"):
            return None
        h = self.get_buffer(key)  # type: ignore[attr-defined]
        return None if h is None else _tensor(h, len(h))

    def batch_get_tensor(self, keys: Sequence[str]) -> List[Any]:
        if not self._tensor_ready("batch_get_tensor"):
            return [None] * len(keys)
        return [None if h is None else _tensor(h, len(h)) for h in self.batch_get_buffer(keys)]  # type: ignore[attr-defined]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the object into the registered buffer and returns a tensor over its bytes
        there (no copy: it aliases the buffer, as Mooncake's), or None."""
        if not self._tensor_ready("get_tensor_into"):
            return None
        if not buffer_ptr:
            _warn("get_tensor_into %s: buffer pointer cannot be null" % key)
            return None
        n = self.get_into(key, buffer_ptr, size)  # type: ignore[attr-defined]
        if n < 0:
            _warn("get_tensor_into %s failed: %d" % (key, n))
            return None
        return _tensor(_view(buffer_ptr, n), n) if n >= HEADER_SIZE else _bad_object()

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[Any]:
        if not self._tensor_ready("batch_get_tensor_into") or len(keys) != len(buffer_ptrs) or len(keys) != len(sizes) or not all(buffer_ptrs):
            return [INVALID_PARAMS] * len(keys)
        out: List[Any] = []
        for p, n in zip(buffer_ptrs, self.batch_get_into(keys, buffer_ptrs, sizes)):  # type: ignore[attr-defined]
            out.append(None if n < 0 else _tensor(_view(p, n), n) if n >= HEADER_SIZE else _bad_object())
        return out

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """batch_get_tensor_into_cuda of one key."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> List[int]:
        """Per key -704 when it is missing, else -600 (logged), as Mooncake answers outside a
        dummy client: its CUDA IPC read path needs Mooncake's dummy client, which kvferry does
        not have; use get_tensor_into on host memory and copy to the device."""
        if not self._tensor_ready("batch_get_tensor_into_cuda") or len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        _warn("batch_get_tensor_into_cuda: CUDA IPC reads need Mooncake's dummy client, which kvferry does not provide; use get_tensor_into and .cuda()")
        exist = self.batch_is_exist(keys)  # type: ignore[attr-defined]
        return [OBJECT_NOT_FOUND if e == 0 else INVALID_PARAMS for e in exist]

    # -- safetensors ----------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: str, file_name: Any = None) -> int:
        """Writes the tensor of ``key`` to a safetensors file (named ``key`` by default)
        holding one entry named ``key``: 0, -1100 when the key has no tensor, -600 when the
        file cannot be written (or safetensors is missing)."""
        if not self._tensor_ready("save_tensor_to_safetensor"):
            return INVALID_PARAMS
        t = self.get_tensor(key)
        if t is None:
            _warn("save_tensor_to_safetensor: no tensor under %r" % key)
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: t}, key if file_name is None else str(file_name))
            return 0
        except Exception as e:  # noqa: BLE001 - Mooncake logs and returns -600
            _warn("save_tensor_to_safetensor %s: %s" % (key, e))
            return INVALID_PARAMS

    def load_tensor_from_safetensor(self, key: Any = None, file_name: str = "") -> Any:
        """Stores a tensor of a safetensors file under ``key`` (default: the file name): the
        entry named ``key`` if there is one, else the first; returns the tensor, or None."""
        if not self._tensor_ready("load_tensor_from_safetensor"):
            return None
        try:
            from safetensors.torch import load_file

            loaded = load_file(file_name)
        except Exception as e:  # noqa: BLE001
            _warn("load_tensor_from_safetensor %s: %s" % (file_name, e))
            return None
        if not loaded:
            _warn("load_tensor_from_safetensor: no tensors in %s" % file_name)
            return None
        target = file_name if key is None else str(key)
        name = target if key is not None and target in loaded else next(iter(loaded))
        t = loaded[name]
        rc = self.put_tensor(target, t)
        if rc != 0:
            _warn("load_tensor_from_safetensor: storing %s failed: %d" % (target, rc))
            return None
        return t


def _bad_object() -> None:
    _warn("invalid data format: the object is shorter than a tensor header")
    return None


def _bad_config(config: Any) -> bool:
    """Mooncake's check of a pub call's ReplicateConfig: preferred_segments, when given, must
    name one segment per replica."""
    prefs = list(getattr(config, "preferred_segments", None) or [])
    if prefs and len(prefs) != getattr(config, "replica_num", 1):
        _warn("preferred_segments has %d entries but replica_num is %s" % (len(prefs), getattr(config, "replica_num", 1)))
        return True
    return False
