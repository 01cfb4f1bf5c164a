"""Mooncake's ``mooncake.async_store`` on kvferry: ``MooncakeDistributedStoreAsync``, the
store whose every method ``m`` also exists as a coroutine ``async_m`` (the call runs in the
event loop's default executor; kvferry's store releases the GIL while it waits)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from .store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """``MooncakeDistributedStore`` plus ``async_<method>`` coroutines, as Mooncake's:
    ``await store.async_put("k", b"v")`` runs ``store.put("k", b"v")`` in the running loop's
    default executor and returns its result. The wrapper is made on first use and kept on
    the instance."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("async_"):
            # Names kvferry does not provide keep their reason (MooncakeDistributedStore's).
            return super().__getattr__(name)
        sync_name = name[len("async_"):]
        try:
            sync = getattr(self, sync_name)
        except AttributeError as e:
            raise AttributeError("'%s' object has no attribute %r (nor %r: %s)" % (type(self).__name__, name, sync_name, e)) from None
        if not callable(sync):
            raise AttributeError("%r is not callable" % sync_name)
        wrapper = _coroutine(sync)
        setattr(self, name, wrapper)
        return wrapper


def _coroutine(sync: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sync)
    async def call(*args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(sync, *args, **kwargs))

    return call
