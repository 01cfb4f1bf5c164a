"""Mooncake's ``mooncake`` package names, on kvferry.

``kvferry.mooncake.engine`` is Mooncake's ``mooncake.engine`` (the TransferEngine API).
``BufferPool``/``RegisteredBufferPool`` belong to ``mooncake.store``, which kvferry does not
provide: they are None, as in a Mooncake install without the store extension.

To make unmodified ``from mooncake.engine import TransferEngine`` resolve here, set
``KVFERRY_MOONCAKE_SHIM=1`` or call :func:`kvferry.install_mooncake_shim` (docs/PYTHON.md).
"""

from . import engine

BufferPool = None
RegisteredBufferPool = None

__all__ = ["BufferPool", "RegisteredBufferPool", "engine"]
