"""batchcast: zero-copy batches from a per-host data-loading broker.

A broker (``batchcast serve``) runs the input pipeline once per host and
shares every batch with every trainer through shared memory. Replace a
DataLoader with a :class:`Consumer`::

    import batchcast
    for epoch in range(epochs):
        for images, labels in batchcast.Consumer(stream="train"):
            ...

or share an existing DataLoader with :class:`Producer`::

    batchcast.Producer(loader, stream="train").run(epochs=90)
"""

import sys
from typing import Optional

from . import _args
from ._batch import Batch
from ._consumer import Consumer
from ._exe import executable
from ._native import PROTOCOL_VERSION, __version__, default_socket_path
from ._producer import Producer
from .errors import (
    BatchReleased,
    BrokerUnavailable,
    DeviceUnavailable,
    Error,
    InvalidArgument,
    SchemaError,
    StreamError,
    VersionMismatch,
    WindowFull,
    RingPinned,
    WindowFullWarning,
)


def _ray_socket() -> Optional[str]:
    """In a Ray worker of a cluster where ``batchcast.ray.init()`` was
    called: its node's broker (Ray is imported only where it already is)."""
    if "ray" not in sys.modules:
        return None
    from . import ray as on_ray

    return on_ray.socket_if_initialized()


_args.add_socket_finder(_ray_socket)

__all__ = [
    "Batch",
    "BatchReleased",
    "BrokerUnavailable",
    "Consumer",
    "DeviceUnavailable",
    "Error",
    "InvalidArgument",
    "PROTOCOL_VERSION",
    "Producer",
    "SchemaError",
    "StreamError",
    "VersionMismatch",
    "WindowFull",
    "RingPinned",
    "WindowFullWarning",
    "__version__",
    "default_socket_path",
    "executable",
]
