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

from ._consumer import Batch, Consumer
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
