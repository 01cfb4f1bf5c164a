"""Mooncake's ``mooncake`` package names, on kvferry.

``kvferry.mooncake.engine`` is Mooncake's ``mooncake.engine`` (the TransferEngine API).
``kvferry.mooncake.store`` is Mooncake's ``mooncake.store`` (MooncakeDistributedStore against
``kvferry master``). ``BufferPool``/``RegisteredBufferPool`` are not provided: they are None,
as in a Mooncake install without them.

To make unmodified ``from mooncake.engine import TransferEngine`` resolve here, set
``KVFERRY_MOONCAKE_SHIM=1`` or call :func:`kvferry.install_mooncake_shim` (docs/PYTHON.md).
"""

from . import engine

BufferPool = None
RegisteredBufferPool = None

__all__ = ["BufferPool", "RegisteredBufferPool", "engine"]
