"""Mooncake's ``mooncake.store`` API on kvferry: ``MooncakeDistributedStore``,
``ReplicateConfig``, ``SoftPinAction``, with Mooncake's return conventions (0 or a negative
error number; ``get`` of a missing key returns ``b""``; ``is_exist`` 1/0/-1).

The master is ``kvferry master`` (its own protocol, not ``mooncake_master``'s)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

from .. import store as _native

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction"]

_log = logging.getLogger("kvferry")
_logged: set = set()

SoftPinAction = _native.SoftPinAction

INVALID_PARAMS = -600
INTERNAL_ERROR = -1


class ReplicateConfig(_native.ReplicateConfig):
    """Mooncake's ReplicateConfig (same fields)."""


def _code(e: BaseException) -> int:
    code = getattr(e, "code", None)
    return code if isinstance(code, int) and code < 0 else INTERNAL_ERROR


def _fail(e: BaseException) -> int:
    msg = "%s: %s" % (type(e).__name__, e)
    if msg not in _logged:
        _logged.add(msg)
        _log.warning("kvferry store: %s", msg)
    return _code(e)


def _ptr(p: Any) -> int:
    if isinstance(p, bool) or not isinstance(p, int):
        raise _native.StoreInvalidArgument("buffer pointers are ints", INVALID_PARAMS)
    return p


class MooncakeDistributedStore:
    """Mooncake Store's Python client API."""

    def __init__(self) -> None:
        self._s: Optional[_native.Store] = None

    def setup(
        self,
        local_hostname: Any = None,
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        **_ignored: Any,
    ) -> int:
        """0 on success. Also accepts one dict with the same keys (Mooncake's dict form)."""
        if isinstance(local_hostname, dict):
            d: Dict[str, Any] = dict(local_hostname)
            if "local_hostname" not in d or "metadata_server" not in d:
                return _fail(_native.StoreInvalidArgument("setup(dict) needs local_hostname and metadata_server", INVALID_PARAMS))
            return self.setup(
                d["local_hostname"],
                d["metadata_server"],
                d.get("global_segment_size", 16 << 20),
                d.get("local_buffer_size", 16 << 20),
                d.get("protocol", "tcp"),
                d.get("device_name", d.get("rdma_devices", "")),
                d.get("master_server_address", d.get("master_server_addr", "127.0.0.1:50051")),
            )
        if local_hostname is None:
            return _fail(_native.StoreInvalidArgument("local_hostname is required", INVALID_PARAMS))
        try:
            self._s = _native.Store(str(local_hostname), metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices or "", master_server_addr)
            return 0
        except Exception as e:  # noqa: BLE001 - the compatible API reports codes
            return _fail(e)

    def _store(self) -> _native.Store:
        if self._s is None:
            raise _native.StoreError("setup() has not succeeded", INTERNAL_ERROR)
        return self._s

    # bytes API
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store().put(key, value, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store().upsert(key, value, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get(self, key: str) -> bytes:
        try:
            return self._store().get(key)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, _native.ObjectNotFound):
                _fail(e)
            return b""

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store().put_batch(keys, values, config)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get_batch(self, keys: Sequence[str]) -> List[bytes]:
        """Values in order; ``b""`` for a missing or failed key."""
        try:
            res = self._store()._core.get_batch([str(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [b"" for _ in keys]
        return [v if code == 0 and v is not None else b"" for v, code, _ in res]

    # zero copy
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._store()._core.register_buffer(_ptr(buffer_ptr), int(size))
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self._store()._core.unregister_buffer(_ptr(buffer_ptr))
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _native._cfg(config), False)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        try:
            self._store()._core.put_from(str(key), _ptr(buffer_ptr), int(size), _native._cfg(config), True)
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, or a negative error number."""
        try:
            return self._store()._core.get_into(str(key), _ptr(buffer_ptr), int(size))
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int], config: Optional[ReplicateConfig] = None) -> List[int]:
        try:
            res = self._store()._core.batch_put_from([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes], _native._cfg(config), False)
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [0 if code == 0 else code for _, code, _ in res]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        try:
            res = self._store()._core.batch_get_into([str(k) for k in keys], [_ptr(p) for p in buffer_ptrs], [int(s) for s in sizes])
        except Exception as e:  # noqa: BLE001
            return [_fail(e)] * len(keys)
        return [int(v) if code == 0 and v is not None else code for v, code, _ in res]

    # queries and removal
    def is_exist(self, key: str) -> int:
        try:
            return 1 if self._store().is_exist(key) else 0
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        try:
            res = self._store()._core.batch_is_exist([str(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            _fail(e)
            return [-1] * len(keys)
        return [(1 if v else 0) if code == 0 else -1 for v, code, _ in res]

    def get_size(self, key: str) -> int:
        try:
            return self._store().get_size(key)
        except Exception as e:  # noqa: BLE001
            return _code(e) if isinstance(e, _native.ObjectNotFound) else _fail(e)

    def remove(self, key: str, force: bool = False) -> int:
        try:
            self._store().remove(key, force)
            return 0
        except Exception as e:  # noqa: BLE001
            return _code(e) if isinstance(e, (_native.ObjectNotFound, _native.ObjectHasLease)) else _fail(e)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        try:
            return self._store().remove_by_regex(regex_pattern, force)
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def remove_all(self, force: bool = False) -> int:
        try:
            return self._store().remove_all(force)
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    def get_hostname(self) -> str:
        return self._store().segment_name if self._s is not None else ""

    def close(self) -> int:
        if self._s is None:
            return 0
        try:
            self._s.close()
            return 0
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        finally:
            self._s = None
