"""Mooncake's ``BufferPool`` / ``RegisteredBufferPool`` on kvferry (``mooncake.buffer_pool``;
also ``mooncake.BufferPool`` and ``mooncake.store.BufferPool``).

A pool of buffers registered with a ``MooncakeDistributedStore``, for zero-copy
``put_from``/``get_into``: ``pool.acquire(size)`` hands out a ``BufferLease`` (``ptr``, ``size``,
``buffer`` -- a writable memoryview -- ``release()``, ``with``) and blocks, fails or times out
when the pool's byte budget (``max_bytes``) or lease count (``max_regions``) is used up, as
Mooncake's does. Mooncake carves leases from the store's local buffer first and registers
"overflow" buffers beyond it; kvferry gives every lease its own mapping registered with the
store (the local buffer stays the store's own staging area), aligned to ``alignment``. The
budget is Mooncake's: ``max_bytes=0`` means twice the store's ``local_buffer_size``, and a
smaller ``max_bytes`` is raised to it. Errors are ``RuntimeError`` with Mooncake's messages.
"""

from __future__ import annotations

import ctypes
import mmap
import operator
import threading
import time
from typing import Any, Optional

__all__ = ["BufferPool", "RegisteredBufferPool", "BufferLease", "RegisteredBufferLease"]

_PAGE = mmap.PAGESIZE


def _size(name: str, v: Any) -> int:
    try:
        n = None if isinstance(v, bool) else operator.index(v)
    except TypeError:
        n = None
    if n is None or n < 0 or n >= 1 << 64:
        raise TypeError("BufferPool: %s must be an integer in [0, 2**64), not %r" % (name, v))
    return n


class _Region:
    __slots__ = ("mm", "base", "addr", "size", "registered")

    def __init__(self, size: int, alignment: int) -> None:
        span = max(size, 1)
        extra = alignment if alignment > _PAGE else 0
        length = -(-(span + extra) // _PAGE) * _PAGE
        self.mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))  # the temporary export ends here
        self.addr = (self.base + alignment - 1) & ~(alignment - 1) if extra else self.base
        self.size = span
        self.registered = False

    def view(self, n: int) -> memoryview:
        off = self.addr - self.base
        return memoryview(self.mm)[off:off + n]


class BufferLease:
    """One buffer of a ``BufferPool``: ``ptr`` (its address, registered with the store),
    ``size`` (the size asked for), ``buffer`` (a writable memoryview of ``size`` bytes),
    ``release()`` (gives it back; raises RuntimeError while memoryviews of it are alive) and
    ``with`` (releases on exit). Dropping the lease releases it too."""

    def __init__(self, pool: "BufferPool", region: _Region, size: int) -> None:
        self._pool: Optional[BufferPool] = pool
        self._region: Optional[_Region] = region
        self._size = size

    @property
    def ptr(self) -> int:
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region.addr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region.view(self._size)

    def release(self) -> None:
        if self._region is None or self._pool is None:
            return
        self._pool._release(self._region, check_views=True)
        self._region, self._pool = None, None

    def __enter__(self) -> "BufferLease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            if self._region is not None and self._pool is not None:
                self._pool._release(self._region, check_views=False)
                self._region, self._pool = None, None
        except Exception:  # noqa: BLE001 - a destructor must not raise (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        state = "released" if self._region is None else "ptr=%#x" % self._region.addr
        return "<BufferLease size=%d %s>" % (self._size, state)


class BufferPool:
    """Mooncake's ``BufferPool(store, max_bytes=0, min_size_class=65536, max_size_class=None,
    alignment=8 MiB, block_on_exhaustion=True, default_timeout=None, max_regions=None,
    prewarm_size=None, prewarm_count=0)``; ``acquire(size, block=None, timeout=None)`` (and
    its alias ``buffer``), ``prewarm(size, count)`` (no effect, as in Mooncake), ``close()``.
    ``store`` is a set-up ``MooncakeDistributedStore`` with a local buffer."""

    def __init__(
        self,
        store: Any,
        max_bytes: int = 0,
        min_size_class: int = 64 * 1024,
        max_size_class: Optional[int] = None,
        alignment: int = 8 * 1024 * 1024,
        block_on_exhaustion: bool = True,
        default_timeout: Optional[float] = None,
        max_regions: Optional[int] = None,
        prewarm_size: Optional[int] = None,
        prewarm_count: int = 0,
    ) -> None:
        max_bytes = _size("max_bytes", max_bytes)
        min_size_class = _size("min_size_class", min_size_class)
        alignment = _size("alignment", alignment)
        if store is None or getattr(store, "_s", None) is None or not hasattr(store, "register_buffer"):
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(store, "_local_buffer_size", 0) or 0)
        if local == 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self._max_bytes = 2 * local if max_bytes == 0 else max(max_bytes, local)
        self._max_size_class = self._max_bytes if max_size_class is None else _size("max_size_class", max_size_class)
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else _size("max_regions", max_regions)
        self._cv = threading.Condition()
        self._in_use: "dict[int, _Region]" = {}
        self._total = 0
        self._reserved = 0
        self._reserved_regions = 0
        self._closed = False
        self._closing = False
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._closing:
            raise RuntimeError("buffer pool is closing")

    def _has_room(self, n: int) -> bool:
        if n > self._max_bytes - self._total - self._reserved:
            return False
        return self._max_regions is None or len(self._in_use) + self._reserved_regions < self._max_regions

    def acquire(self, size: int, block: Optional[bool] = None, timeout: Optional[float] = None) -> BufferLease:
        """A lease of ``size`` bytes. When the pool is full: waits (``block``, default the
        pool's ``block_on_exhaustion``) up to ``timeout`` seconds (default the pool's
        ``default_timeout``; None waits for ever), or raises RuntimeError."""
        size = _size("size", size)
        should_block = self._block if block is None else bool(block)
        t = self._timeout if timeout is None else float(timeout)
        if t is not None and t < 0:
            raise RuntimeError("timeout must be non-negative")
        n = max(size, 1)
        if n > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if t is None else time.monotonic() + t
        with self._cv:
            while True:
                self._check_open()
                if self._has_room(n):
                    self._reserved += n
                    self._reserved_regions += 1
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cv.wait(left)
        region = None
        try:
            region = _Region(n, self._alignment)
            if self._store.register_buffer(region.addr, region.size) != 0:
                raise RuntimeError("overflow buffer registration failed (the store's log says why)")
            region.registered = True
        except BaseException:
            with self._cv:
                self._reserved -= n
                self._reserved_regions -= 1
                self._cv.notify_all()
            if region is not None:
                region.mm.close()
            raise
        with self._cv:
            self._reserved -= n
            self._reserved_regions -= 1
            if self._closing or self._closed:
                self._cv.notify_all()
                self._store.unregister_buffer(region.addr)
                region.mm.close()
                raise RuntimeError("buffer pool is closing")
            self._in_use[region.addr] = region
            self._total += n
            return BufferLease(self, region, size)

    def buffer(self, size: int, block: Optional[bool] = None, timeout: Optional[float] = None) -> BufferLease:
        """Same as :meth:`acquire`."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """No effect (as in Mooncake)."""

    def _release(self, region: _Region, check_views: bool) -> None:
        with self._cv:
            if self._in_use.get(region.addr) is not region:
                raise RuntimeError("buffer lease is not active")
            if region.registered:
                self._store.unregister_buffer(region.addr)
                region.registered = False
            try:
                region.mm.close()
            except BufferError:
                if check_views:
                    region.registered = self._store.register_buffer(region.addr, region.size) == 0
                    raise RuntimeError("cannot release buffer while exported views exist") from None
                # Dropped with views alive: the views keep the mapping; it is no longer registered.
            del self._in_use[region.addr]
            self._total -= region.size
            self._cv.notify_all()

    def close(self) -> None:
        """Closes the pool: waits for acquisitions in progress, then raises RuntimeError if
        leases are still held; later ``acquire`` calls raise."""
        with self._cv:
            if self._closed:
                return
            self._closing = True
            while self._reserved_regions:
                self._cv.wait()
            self._closing = False
            if self._in_use:
                self._cv.notify_all()
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cv.notify_all()

    def __repr__(self) -> str:
        return "<BufferPool max_bytes=%d in_use=%d leases=%d%s>" % (self._max_bytes, self._total, len(self._in_use), " closed" if self._closed else "")


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
