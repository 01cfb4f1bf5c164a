"""kvferry: a KV-cache transfer engine, wire-compatible with Mooncake's transfer engine.

Two APIs over one engine:

- :class:`kvferry.Engine` -- the native API: typed exceptions carrying the reason, local
  memory as integer addresses or buffer objects (bytearray, memoryview, numpy arrays, ...)::

      import kvferry
      with kvferry.Engine("127.0.0.1") as eng:
          buf = bytearray(1 << 20)
          eng.register_memory(buf)
          remote = eng.segment_buffers(peer)[0].addr
          eng.write(peer, buf, remote)            # raises kvferry.TransferError & co.

- :mod:`kvferry.mooncake.engine` -- Mooncake's ``mooncake.engine`` API (``TransferEngine``
  with ``initialize``, ``transfer_sync_write``, ... returning 0/-1). Opt in with
  ``KVFERRY_MOONCAKE_SHIM=1`` or :func:`install_mooncake_shim` to make unmodified
  ``from mooncake.engine import TransferEngine`` use kvferry.

This version moves host memory: over TCP to any peer (kvferry or stock Mooncake), by shared
memory between kvferry processes on one host (memory from ``allocate_managed_buffer`` is mapped
by the peer, other memory reached by cross-memory attach), memcpy within one engine. Segments
are found by P2PHANDSHAKE or a metadata service (http(s), etcd, redis). Configuration: ``KVFERRY_*`` environment variables and Mooncake's ``MC_*``
aliases (``MC_TRANSFER_TIMEOUT``, ``MC_MIN_RPC_PORT``, ...). Engine logs: ``KVFERRY_LOG=info``.
"""

from ._kvferry import __version__
from ._errors import *  # noqa: F403  (exactly the names of _errors.__all__)
from ._errors import __all__ as _ERRORS
from ._engine import Batch, Engine, FailCause, Notify, Opcode, Region, Status, TaskStatus, features


def install_mooncake_shim() -> None:
    """Makes ``import mooncake`` / ``import mooncake.engine`` resolve to kvferry's
    Mooncake-compatible modules in this process (idempotent). Same as starting Python with
    ``KVFERRY_MOONCAKE_SHIM=1``. ``mooncake.store`` resolves to :mod:`kvferry.mooncake.store`;
    other ``mooncake.*`` modules then raise
    ModuleNotFoundError."""
    from . import _shim

    _shim.install()


def uninstall_mooncake_shim() -> None:
    """Undoes :func:`install_mooncake_shim`."""
    from . import _shim

    _shim.uninstall()


__all__ = [
    "__version__",
    "Engine",
    "Batch",
    "Opcode",
    "TaskStatus",
    "FailCause",
    "Status",
    "Notify",
    "Region",
    "features",
    "install_mooncake_shim",
    "uninstall_mooncake_shim",
] + list(_ERRORS)
