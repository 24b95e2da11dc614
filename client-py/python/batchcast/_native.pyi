"""Type stubs of the native module (Rust, PyO3). Use the `batchcast` package
API instead of this module directly."""

from typing import Any, Dict, List, Optional, Tuple, Union

PROTOCOL_VERSION: int
CONSUMER_OPTIONS: List[Dict[str, Any]]
__version__: str

def default_socket_path() -> str: ...

class Consumer:
    def __init__(
        self,
        stream: Optional[str] = None,
        socket: Optional[str] = None,
        window: Optional[int] = None,
        join: Optional[str] = None,
        name: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        device: Optional[str] = None,
        broker_uid: Optional[int] = None,
        batch_size: Optional[int] = None,
        drop_last: Optional[bool] = None,
        resume: Optional[Tuple[int, int]] = None,
        state: Optional[Dict[str, Any]] = None,
        reconnect_timeout: Optional[float] = None,
        group: Optional[str] = None,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        replicate: Optional[int] = None,
    ) -> None: ...
    def state(self) -> Dict[str, Any]: ...
    def next_event(
        self, timeout: Optional[float] = None
    ) -> Optional[Union[Tuple[str, "Batch"], Tuple[str, int, int, bool], Tuple[str]]]: ...
    def schema(self) -> Dict[str, Any]: ...
    @property
    def window(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def batches_per_epoch(self) -> int: ...
    @property
    def start_epoch(self) -> int: ...
    @property
    def owner_uid(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def reconnects(self) -> int: ...
    @property
    def arena(self) -> Tuple[int, int]: ...
    @property
    def device(self) -> Tuple[int, int]: ...

class Batch:
    seq: int
    epoch: int
    index: int
    samples: int
    first_sample: int
    replayed: bool
    next_position: Tuple[int, int]
    wait_s: float
    handoff_s: float
    def field(self, i: int, host: bool = False) -> "DLField": ...
    def release(self) -> None: ...
    @property
    def released(self) -> bool: ...

class DLField:
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def data_ptr(self) -> int: ...

class Producer:
    def __init__(
        self,
        stream: str,
        fields: List[Tuple[str, str, List[int]]],
        batch_size: int,
        batches_per_epoch: int,
        epochs: Optional[int] = None,
        slots: int = 4,
        min_consumers: int = 1,
        lag_limit: Optional[int] = None,
        hold_limit_s: Optional[float] = None,
        socket: Optional[str] = None,
        name: Optional[str] = None,
        description: str = "",
        classes: List[str] = ...,
        connect_timeout: float = 0.0,
        broker_uid: Optional[int] = None,
        reconnect_timeout: Optional[float] = None,
        rejoin_grace: Optional[float] = None,
    ) -> None: ...
    def schema(self) -> Dict[str, Any]: ...
    def acquire(self) -> Optional[Tuple[int, int, int]]: ...
    def write(self, field: int, array: Any) -> None: ...
    def publish(self, samples: int) -> None: ...
    def fail(self, message: str) -> None: ...
    def close(self) -> None: ...
