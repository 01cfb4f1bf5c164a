"""The exceptions of kvferry's native API.

Every exception is a :class:`KvferryError` carrying the reason as its message and, in
``code``, the number Mooncake's API would have returned for the same failure (``-1``
invalid argument, ``-3`` address not registered, ``-7`` overlap, ``-101``/``-102`` peer
unreachable, ``-200`` segment not found, ...).
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "KvferryError",
    "InvalidArgument",
    "ConfigError",
    "AddressNotRegistered",
    "AddressOverlap",
    "SegmentNotFound",
    "BatchBusy",
    "TooManyRequests",
    "TransferError",
    "TransferTimeout",
    "PeerUnreachable",
    "EngineClosed",
]


class KvferryError(Exception):
    """Base class of every kvferry error.

    Attributes:
        reason: what went wrong and what to do about it (also ``str(exc)``).
        code: Mooncake's numeric error code for this failure (negative), or None.
        cause: for a failed transfer, why, as a ``kvferry.FailCause`` code (an int), else None.
    """

    cause: Optional[int] = None

    def __init__(self, message: str = "", code: Optional[int] = None) -> None:
        super().__init__(message)
        self.reason = message
        self.code = code


class InvalidArgument(KvferryError, ValueError, TypeError):
    """An argument has the wrong type or value (negative length, mismatched lists, bad
    location string, unknown batch id, ...). Also a ``ValueError`` and a ``TypeError``."""


class ConfigError(InvalidArgument):
    """The engine cannot start with this configuration (environment variables, metadata
    server other than ``P2PHANDSHAKE``, an address this host does not have, no free port)."""


class AddressNotRegistered(KvferryError):
    """A local or remote range is not inside registered memory (code -3)."""


class AddressOverlap(KvferryError):
    """A range to register overlaps one already registered (code -7)."""


class SegmentNotFound(KvferryError, LookupError):
    """A segment name cannot be opened: malformed (``host:rpc_port`` expected), or its
    handshake port does not answer with a valid descriptor (code -200)."""


class BatchBusy(KvferryError):
    """A batch cannot be freed while tasks are in flight (code -4)."""


class TooManyRequests(KvferryError):
    """More requests than the batch's capacity (code -2)."""


class TransferError(KvferryError):
    """A transfer ended FAILED; the message gives the engine's reason."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not finish before its deadline. Also a builtin ``TimeoutError``."""


class PeerUnreachable(KvferryError, ConnectionError):
    """A peer's handshake port cannot be reached or answered badly (probe, notify).
    Also a builtin ``ConnectionError``."""


class EngineClosed(KvferryError):
    """The engine was closed."""
