"""What the consumer and the producer share about their arguments: the
socket they connect to by default and the connect timeout from the
environment. The checks on the other arguments are the native module's
(Rust's), so errors read the same from both clients."""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Union

from .errors import InvalidArgument

PathLike = Union[str, "os.PathLike[str]"]

# Where a client finds its broker when given no socket and
# ``$BATCHCAST_SOCKET`` is unset, asked in order until one answers (the
# package registers Ray's: the broker of the node a Ray worker runs on);
# none answering leaves the native client's default.
_SOCKET_FINDERS: List[Callable[[], Optional[str]]] = []


def add_socket_finder(finder: Callable[[], Optional[str]]) -> None:
    """Adds ``finder`` (a socket path, or ``None`` when it has none) to
    those asked for a client's default socket."""
    _SOCKET_FINDERS.append(finder)


def env_timeout() -> float:
    raw = os.environ.get("BATCHCAST_CONNECT_TIMEOUT", "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise InvalidArgument(
            f"BATCHCAST_CONNECT_TIMEOUT={raw!r} is not a number of seconds"
        ) from None
    return max(value, 0.0)


def default_socket(socket: Optional[PathLike]) -> Optional[str]:
    """The socket a consumer or producer connects to: ``socket`` if given;
    else, with ``$BATCHCAST_SOCKET`` unset, the first a registered finder
    gives (in a Ray worker of a cluster where ``batchcast.ray.init()`` was
    called, the broker of its node); otherwise ``None``, the native
    client's usual default."""
    if socket is not None:
        return os.fspath(socket)
    if os.environ.get("BATCHCAST_SOCKET"):
        return None
    for finder in _SOCKET_FINDERS:
        found = finder()
        if found is not None:
            return found
    return None
