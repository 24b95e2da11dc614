"""Exceptions raised by batchcast.

Each subclasses the built-in that fits, so code that already handles
``ConnectionError`` or ``ValueError`` keeps working, and ``batchcast.Error``
catches them all. ``code`` is the broker's error code when it sent one
(e.g. ``"UnknownStream"``, ``"LagLimit"``, ``"SourceFailed"``).
"""

from __future__ import annotations

from typing import Optional


class Error(Exception):
    """Base class of every batchcast exception."""

    code: Optional[str] = None


class BrokerUnavailable(Error, ConnectionError):
    """No broker at the socket, it went away (exited or was killed), it is
    not the user it should be, it refused this user, or it is at a
    connection limit (``code`` is ``"NotAllowed"`` or ``"Busy"`` then, and
    the message names the limit)."""


class VersionMismatch(Error, RuntimeError):
    """The broker is from a release that speaks another protocol. The
    message names both releases (``batchcast --version`` and
    ``batchcast.__version__`` show yours) and which one to upgrade."""


class StreamError(Error, RuntimeError):
    """The broker refused or ended the subscription, or the protocol broke:
    an unknown stream, a consumer detached for lagging, a failed source."""


class SchemaError(Error, ValueError):
    """A batch does not fit its stream's schema (field names, dtypes,
    per-sample shapes, batch size)."""


class InvalidArgument(Error, ValueError):
    """A bad argument to a batchcast call."""


class BatchReleased(Error, ValueError):
    """A released batch was used; its slot may already hold another batch."""


class WindowFull(Error, RuntimeError):
    """The consumer holds its whole window of batches and no other thread
    can release one."""


class RingPinned(WindowFull):
    """The program keeps a batch from a whole ring of slots ago while asking
    for new ones: the broker cannot make the next batch until it is
    released. Drop old batches (copy what you keep, e.g. ``copy=True``)."""


class DeviceUnavailable(Error, RuntimeError):
    """Batches cannot be delivered on the GPU asked for: no CUDA driver on
    this host, no such device, a broker without GPU support, or a CUDA error
    (named in the message). ``device="cpu"`` still works."""


class WindowFullWarning(ResourceWarning):
    """A consumer waits for a batch while holding its whole window."""


__all__ = [
    "Error",
    "BrokerUnavailable",
    "StreamError",
    "SchemaError",
    "InvalidArgument",
    "BatchReleased",
    "WindowFull",
    "RingPinned",
    "WindowFullWarning",
    "DeviceUnavailable",
]
