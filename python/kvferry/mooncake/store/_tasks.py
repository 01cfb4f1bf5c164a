"""Mooncake 0.3.14's replica copy and move tasks: ``create_copy_task``, ``create_move_task``,
``query_task``, and the module's ``TaskType``, ``TaskStatus`` and ``QueryTaskResponse``."""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence, Tuple

from ._common import _fail

#: Mooncake's null UUID, what a failed create returns as the task id.
_NO_TASK = (0, 0)


class TaskType(enum.IntEnum):
    """Mooncake's ``TaskType``."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """Mooncake's ``TaskStatus`` (in its order; FAILED is 2, SUCCESS 3, as Mooncake numbers
    them)."""

    PENDING = 0
    PROCESSING = 1
    SUCCESS = 3
    FAILED = 2


class QueryTaskResponse:
    """Mooncake's ``QueryTaskResponse``: a task's id and type, its status, when it was created
    and last updated (ms since the epoch), the client it was assigned to (a UUID pair; kvferry's
    client ids are 64-bit: ``(0, id)``) and its message (empty until it ended)."""

    __slots__ = ("id", "type", "status", "created_at_ms_epoch", "last_updated_at_ms_epoch", "assigned_client", "message")

    def __init__(self) -> None:
        self.id: Tuple[int, int] = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client: Tuple[int, int] = (0, 0)
        self.message = ""

    @classmethod
    def _of(cls, t: Any) -> "QueryTaskResponse":
        r = cls()
        r.id, kind, status, r.created_at_ms_epoch, r.last_updated_at_ms_epoch, r.assigned_client, r.message = t
        r.id, r.assigned_client = tuple(r.id), tuple(r.assigned_client)
        r.type, r.status = TaskType(kind), TaskStatus(status)
        return r

    def __repr__(self) -> str:
        return 'QueryTaskResponse(id=%d-%d, type=%d, status=%d, created_at=%d, last_updated_at=%d, assigned_client=%d-%d, message="%s")' % (
            self.id[0], self.id[1], int(self.type), int(self.status), self.created_at_ms_epoch,
            self.last_updated_at_ms_epoch, self.assigned_client[0], self.assigned_client[1], self.message)


def _task_id(task_id: Any) -> Tuple[int, int]:
    hi, lo = task_id
    return int(hi), int(lo)


class _Tasks:
    """The task calls of ``MooncakeDistributedStore``. A task runs in the background thread of
    the client owning the replica it copies (every ping interval, as Mooncake's task poll
    thread); poll :meth:`query_task` for its end."""

    def create_copy_task(self, key: str, targets: Sequence[str]) -> Tuple[Tuple[int, int], int]:
        """Copy ``key`` to each segment of ``targets`` (segment names, as ``get_hostname()``
        names them) that holds no replica of it: ``(task_id, 0)``, or ``((0, 0), code)``
        (-600 no target or one not mounted, -704 no such key, -1401 too many tasks
        pending)."""
        try:
            return tuple(self._store()._core.create_copy_task(str(key), [str(t) for t in targets])), 0  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001
            return _NO_TASK, _fail(e)

    def create_move_task(self, key: str, source: str, target: str) -> Tuple[Tuple[int, int], int]:
        """Move ``key``'s replica on segment ``source`` to segment ``target``: ``(task_id,
        0)`` or ``((0, 0), code)`` (-600 source is target, target not mounted or no replica
        on source; -704 no such key)."""
        try:
            return tuple(self._store()._core.create_move_task(str(key), str(source), str(target))), 0  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001
            return _NO_TASK, _fail(e)

    def query_task(self, task_id: Tuple[int, int]) -> Tuple[Optional[QueryTaskResponse], int]:
        """``(QueryTaskResponse, 0)``, or ``(None, code)`` (-1400: no such task, or finished
        long ago, or created before the master restarted)."""
        tid = _task_id(task_id)  # (not a pair: TypeError, as Mooncake's binding raises)
        try:
            return QueryTaskResponse._of(self._store()._core.query_task(tid)), 0  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001
            return None, _fail(e)
