"""Mooncake's ``mooncake`` package names, on kvferry.

``kvferry.mooncake.engine`` is Mooncake's ``mooncake.engine`` (the TransferEngine API).
``kvferry.mooncake.store`` is Mooncake's ``mooncake.store`` (MooncakeDistributedStore against
``kvferry master``). ``BufferPool``/``RegisteredBufferPool`` (``kvferry.mooncake.buffer_pool``)
are Mooncake's pool of store-registered buffers. ``kvferry.mooncake.http_metadata_server`` is
Mooncake's HTTP metadata server module.

To make unmodified ``from mooncake.engine import TransferEngine`` resolve here, set
``KVFERRY_MOONCAKE_SHIM=1`` or call :func:`kvferry.install_mooncake_shim` (docs/PYTHON.md).
"""

from . import engine

from .buffer_pool import BufferPool, RegisteredBufferPool

__all__ = ["BufferPool", "RegisteredBufferPool", "engine"]
