"""What every part of the store shim shares: the logger, failure codes, argument checks."""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

from ... import store as _native
from ._types import _U64, INTERNAL_ERROR, OBJECT_ALREADY_EXISTS

_log = logging.getLogger("kvferry")
_logged: set = set()

def _parse_size(v: Any) -> Optional[int]:
    """Mooncake's try_string_to_byte_size: "16777216", "16MB", "16 mb", "1.5 GB", "infinite";
    None for what it cannot parse ("50%", "-1", "")."""
    s = str(v).strip()
    if not s:
        return None
    if s == "infinite":
        return _U64 - 1
    m = re.match(r"[+-]?(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)", s)
    if not m:
        return None
    value = float(m.group(0))
    if value < 0:
        return None
    unit = s[m.end():].strip().upper()
    mult = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}.get(unit)
    if mult is None:
        return None
    return min(int(value * mult), _U64 - 1)


def _parse_bool(v: Any, default: bool) -> bool:
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    _log.warning("kvferry store: invalid boolean %r, using %s", v, default)
    return default


_MIN_SEGMENT = 1024
_MAX_SEGMENT = 1 << 40


def _code(e: BaseException) -> int:
    code = getattr(e, "code", None)
    return code if isinstance(code, int) and code < 0 else INTERNAL_ERROR


def _fail(e: BaseException) -> int:
    msg = "%s: %s" % (type(e).__name__, e)
    if msg not in _logged:
        _logged.add(msg)
        _log.warning("kvferry store: %s", msg)
    return _code(e)


def _put_fail(e: BaseException) -> int:
    """A put of a key that exists succeeds and keeps the stored value (Mooncake's Put and
    BatchPut treat OBJECT_ALREADY_EXISTS as success); use upsert to replace."""
    return 0 if isinstance(e, _native.ObjectAlreadyExists) else _fail(e)


def _put_code(code: int) -> int:
    """A per-key put result: -705 (the key exists) counts as success, as in Mooncake."""
    return 0 if code == OBJECT_ALREADY_EXISTS else code


def _ptr(p: Any) -> int:
    if isinstance(p, bool) or not isinstance(p, int):
        raise _native.StoreInvalidArgument("buffer pointers are ints", INVALID_PARAMS)
    return p



def _cfg(config: Any, n: int, single: bool = False) -> Any:
    """``config`` as the native call takes it, after Mooncake 0.3.14's check of its per-key
    lists against the call's ``n`` keys (StoreInvalidArgument, -600, on a mismatch)."""
    check = getattr(config, "_check_keys", None)
    if check is not None:
        check(n, single)
    return _native._cfg(config)
