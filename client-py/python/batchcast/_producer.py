"""The producer: share any iterable of batches (e.g. a PyTorch DataLoader)
through the broker."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy

from . import _native
from ._args import PathLike, default_socket, env_timeout
from .errors import InvalidArgument, SchemaError, StreamError

_NUMPY_DTYPES = {
    "uint8": "u8",
    "int8": "i8",
    "uint16": "u16",
    "int16": "i16",
    "uint32": "u32",
    "int32": "i32",
    "uint64": "u64",
    "int64": "i64",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "bool": "bool",
}

_END = object()


def _to_array(value: Any, where: str) -> Tuple[Any, str]:
    """A C-contiguous numpy array sharing the value's memory where it can,
    and its batchcast dtype name."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        if not isinstance(value, torch.Tensor):
            raise SchemaError(f"{where} is a {type(value).__name__}; share tensors or arrays only")
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bf16"
        array = t.numpy()
    elif isinstance(value, numpy.ndarray):
        array = numpy.ascontiguousarray(value)
    else:
        raise SchemaError(
            f"{where} is a {type(value).__name__}; only tensors and numpy arrays can be shared. "
            "Drop it in the collate function, or turn it into an array"
        )
    dtype = _NUMPY_DTYPES.get(array.dtype.name)
    if dtype is None:
        raise SchemaError(f"{where} has dtype {array.dtype}, which batchcast cannot share")
    return array, dtype


class _Layout:
    """What the first batch looked like: its kind, field names, dtypes and
    per-sample shapes. Later batches must match it."""

    def __init__(self, batch: Any, names: Optional[Sequence[str]]) -> None:
        if isinstance(batch, dict):
            self.kind = "dict"
            keys = list(batch)
            if not all(isinstance(k, str) for k in keys):
                raise SchemaError(f"batch keys must be strings, got {keys}")
            self.keys: List[Any] = keys
            default_names = keys
        elif isinstance(batch, (tuple, list)):
            self.kind = "sequence"
            self.keys = list(range(len(batch)))
            default_names = [str(i) for i in self.keys]
        else:
            self.kind = "single"
            self.keys = [None]
            default_names = ["0"]
        if not self.keys:
            raise SchemaError("the first batch is empty: it has no fields")
        if names is not None:
            names = [str(n) for n in names]
            if len(names) != len(self.keys):
                raise InvalidArgument(
                    f"names={names} gives {len(names)} names for {len(self.keys)} fields"
                )
            self.names = names
        else:
            self.names = list(default_names)
        arrays, samples = self._arrays(batch, check=False)
        self.batch_size = samples
        self.fields = [
            (name, dtype, list(a.shape[1:]))
            for name, (a, dtype) in zip(self.names, arrays)
        ]

    def _items(self, batch: Any) -> List[Any]:
        if self.kind == "dict":
            if not isinstance(batch, dict) or list(batch) != self.keys:
                got = list(batch) if isinstance(batch, dict) else type(batch).__name__
                raise SchemaError(f"a batch has keys {got}, but the first had {self.keys}")
            return [batch[k] for k in self.keys]
        if self.kind == "sequence":
            if not isinstance(batch, (tuple, list)) or len(batch) != len(self.keys):
                got = len(batch) if isinstance(batch, (tuple, list)) else type(batch).__name__
                raise SchemaError(f"a batch has {got} fields, but the first had {len(self.keys)}")
            return list(batch)
        return [batch]

    def _arrays(self, batch: Any, check: bool) -> Tuple[List[Tuple[Any, str]], int]:
        out = []
        samples = None
        for i, value in enumerate(self._items(batch)):
            name = self.names[i]
            array, dtype = _to_array(value, f"field {name!r}")
            if array.ndim == 0:
                raise SchemaError(
                    f"field {name!r} is a scalar; every field needs a leading batch dimension"
                )
            if samples is None:
                samples = array.shape[0]
            elif array.shape[0] != samples:
                raise SchemaError(
                    f"field {name!r} has {array.shape[0]} samples but field {self.names[0]!r} has {samples}"
                )
            if check:
                _, want_dtype, want_shape = self.fields[i]
                if dtype != want_dtype or list(array.shape[1:]) != want_shape:
                    raise SchemaError(
                        f"field {name!r} is {dtype} {list(array.shape[1:])} per sample, but the stream "
                        f"was registered from the first batch as {want_dtype} {want_shape}. Make every "
                        "batch the same shape (e.g. resize or crop images to one size in the dataset)"
                    )
            out.append((array, dtype))
        if not samples:
            raise SchemaError("a batch holds no samples")
        if check and samples > self.batch_size:
            raise SchemaError(
                f"a batch holds {samples} samples, more than the first batch's {self.batch_size}, "
                "which set the stream's batch size"
            )
        return out, samples

    def arrays(self, batch: Any) -> Tuple[List[Any], int]:
        arrays, samples = self._arrays(batch, check=True)
        return [a for a, _ in arrays], samples


def _describe(loader: Any) -> Tuple[str, List[str]]:
    dataset = getattr(loader, "dataset", None)
    text = type(loader).__name__
    if dataset is not None:
        text += f"({type(dataset).__name__})"
    classes = getattr(dataset, "classes", None)
    if not (isinstance(classes, (list, tuple)) and all(isinstance(c, str) for c in classes)):
        classes = []
    return text, list(classes)


class Producer:
    """Shares an existing loader through the broker.

    ``loader`` is any iterable of batches: tuples, lists or dicts of torch
    tensors or numpy arrays, or single tensors. A
    ``torch.utils.data.DataLoader`` is the usual one::

        loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=8)
        batchcast.Producer(loader, stream="train").run(epochs=90)

    and each trainer reads it with ``batchcast.Consumer(stream="train")``.

    The first batch fixes the schema: field names (dict keys; ``"0"``,
    ``"1"``, ... for tuples, or ``names=``), dtypes, per-sample shapes and
    the batch size. Each batch is copied once into shared memory. A batch
    with fewer samples (the short last batch of ``drop_last=False``) is sent
    as is, with its valid count, and consumers get tensors of that length.
    A batch that departs from the schema otherwise (another dtype or
    per-sample shape, more samples, other fields) stops the stream with a
    :class:`batchcast.SchemaError` here and a clear error in every consumer.

    One epoch is one pass over ``loader``; it must yield ``len(loader)``
    batches (or ``batches_per_epoch=``). If every consumer leaves mid-epoch
    and a new one subscribes, the broker skips to the next epoch and the
    producer starts a fresh pass.

    Arguments:
        stream: the name consumers subscribe to.
        socket: the broker's socket (see :class:`Consumer`).
        epochs: epochs to produce; ``None`` for endless (until interrupted).
        names: field names for tuple batches.
        slots: batches in shared memory at once (≥ 2).
        min_consumers: consumers that must subscribe before the first batch.
        lag_limit: detach a consumer this many batches behind the others.
        hold_limit_s: detach a consumer that keeps this producer waiting
            this many seconds while another consumer waits for data (it
            paused: stopped, at a breakpoint, a long evaluation); default
            2, at most 86400 (one holding the batch needed next: 30, or
            this if longer).
        batches_per_epoch: for loaders without ``len()``.
        name: shown in ``batchcast stats``.
        connect_timeout: seconds to keep retrying while the broker is not up
            yet; default ``$BATCHCAST_CONNECT_TIMEOUT`` or 0.
        broker_uid: the uid the broker must run as (see :class:`Consumer`).
            Registering on another user's broker: that broker's
            ``guest_stream_prefix`` applies (default ``"{user}."``).
        reconnect_timeout: when the broker goes away (killed, restarted),
            wait this many seconds for it to come back, register the stream
            again and go on; the loader is not rewound. The last ``slots``
            batches are published again from memory this process still
            holds, so consumers that come back resume where they were.
            ``0``: fail at once. Default ``$BATCHCAST_RECONNECT_TIMEOUT``,
            else 60.
        rejoin_grace: registering again, how many seconds the new broker
            holds the stream for the consumers it had (default 10).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        stream: str = "train",
        socket: Optional[PathLike] = None,
        epochs: Optional[int] = None,
        names: Optional[Sequence[str]] = None,
        slots: int = 4,
        min_consumers: int = 1,
        lag_limit: Optional[int] = None,
        batches_per_epoch: Optional[int] = None,
        name: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        broker_uid: Optional[int] = None,
        reconnect_timeout: Optional[float] = None,
        rejoin_grace: Optional[float] = None,
        hold_limit_s: Optional[float] = None,
    ) -> None:
        self.loader = loader
        self.broker_uid = broker_uid
        self.stream = stream
        self.socket = default_socket(socket)
        self.epochs = epochs
        self.names = names
        self.slots = slots
        self.min_consumers = min_consumers
        self.lag_limit = lag_limit
        self.hold_limit_s = hold_limit_s
        self.batches_per_epoch = batches_per_epoch
        self.name = name
        self.connect_timeout = env_timeout() if connect_timeout is None else float(connect_timeout)
        self.reconnect_timeout = None if reconnect_timeout is None else float(reconnect_timeout)
        self.rejoin_grace = None if rejoin_grace is None else float(rejoin_grace)
        #: Filled by run(): the stream's schema as the broker registered it.
        self.schema: Optional[Dict[str, Any]] = None

    def _epoch_length(self) -> int:
        if self.batches_per_epoch is not None:
            n = self.batches_per_epoch
        else:
            try:
                n = len(self.loader)  # type: ignore[arg-type]
            except TypeError:
                raise InvalidArgument(
                    "the loader has no len(); pass batches_per_epoch= to Producer"
                ) from None
        if n == 0:
            raise InvalidArgument("the loader yields no batch: its len() is 0")
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"batches per epoch must be a positive integer, not {n!r}")
        return n

    def run(self, epochs: Optional[int] = None) -> Dict[str, float]:
        """Produces ``epochs`` epochs (default: the constructor's), blocking
        until they are all handed to the broker; returns throughput
        figures. Ctrl-C stops the stream and tells the consumers."""
        epochs = self.epochs if epochs is None else epochs
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise InvalidArgument(f"epochs={epochs!r} must be a positive integer or None")
        per_epoch = self._epoch_length()
        it: Iterator[Any] = iter(self.loader)
        first = next(it, _END)
        if first is _END:
            raise InvalidArgument("the loader yielded no batch")
        layout = _Layout(first, self.names)
        description, classes = _describe(self.loader)
        native = _native.Producer(
            self.stream,
            layout.fields,
            layout.batch_size,
            per_epoch,
            epochs=epochs,
            slots=self.slots,
            min_consumers=self.min_consumers,
            lag_limit=self.lag_limit,
            hold_limit_s=self.hold_limit_s,
            socket=self.socket,
            name=self.name,
            description=description,
            classes=classes,
            connect_timeout=self.connect_timeout,
            broker_uid=self.broker_uid,
            reconnect_timeout=self.reconnect_timeout,
            rejoin_grace=self.rejoin_grace,
        )
        self.schema = native.schema()
        t0 = time.perf_counter()
        published = 0
        samples_total = 0
        wait_s = 0.0
        epoch, index = 0, 0
        pending: Any = first
        try:
            while epochs is None or epoch < epochs:
                if pending is _END:
                    pending = self._next(it, epoch, index, per_epoch)
                w0 = time.perf_counter()
                slot = native.acquire()
                wait_s += time.perf_counter() - w0
                if slot is None:
                    break
                _, want_epoch, want_index = slot
                if (want_epoch, want_index) != (epoch, index):
                    if want_index != 0 or want_epoch < epoch:
                        raise StreamError(
                            f"the broker asked for batch {want_index} of epoch {want_epoch} while "
                            f"this producer is at batch {index} of epoch {epoch}"
                        )
                    # Nobody watched the rest of this epoch: start that one afresh.
                    epoch, index = want_epoch, 0
                    it = iter(self.loader)
                    pending = self._next(it, epoch, index, per_epoch)
                arrays, samples = layout.arrays(pending)
                pending = _END
                for i, array in enumerate(arrays):
                    native.write(i, array)
                native.publish(samples)
                published += 1
                samples_total += samples
                index += 1
                if index == per_epoch:
                    extra = next(it, _END)
                    if extra is not _END:
                        raise SchemaError(
                            f"the loader yielded more than {per_epoch} batches in epoch {epoch}; "
                            "len(loader) (or batches_per_epoch=) must match what it yields"
                        )
                    epoch, index = epoch + 1, 0
                    if epochs is None or epoch < epochs:
                        it = iter(self.loader)
        except BaseException as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            try:
                native.fail(why)
            except Exception:
                pass
            raise
        native.close()
        seconds = time.perf_counter() - t0
        return {
            "batches": published,
            "samples": samples_total,
            "epochs": epoch,
            "seconds": seconds,
            "batches_per_s": published / seconds if seconds > 0 else 0.0,
            "wait_s": wait_s,
        }

    def _next(self, it: Iterator[Any], epoch: int, index: int, per_epoch: int) -> Any:
        batch = next(it, _END)
        if batch is _END:
            raise SchemaError(
                f"the loader ended after {index} batches in epoch {epoch}, but len(loader) "
                f"(or batches_per_epoch=) said {per_epoch}"
            )
        return batch
