"""The consumer: batches of a broker's stream as tensors, zero-copy."""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _native
from .errors import InvalidArgument, WindowFullWarning

PathLike = Union[str, "os.PathLike[str]"]


def _env_timeout() -> float:
    raw = os.environ.get("BATCHCAST_CONNECT_TIMEOUT", "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise InvalidArgument(
            f"BATCHCAST_CONNECT_TIMEOUT={raw!r} is not a number of seconds"
        ) from None
    return max(value, 0.0)


def _default_socket(socket: Optional[PathLike]) -> Optional[str]:
    """The socket a consumer or producer connects to when given none: in a
    Ray worker of a cluster where ``batchcast.ray.init()`` was called (and
    ``$BATCHCAST_SOCKET`` is unset), the broker of the node it runs on;
    otherwise ``None``, the client's usual default."""
    if socket is not None:
        return os.fspath(socket)
    if os.environ.get("BATCHCAST_SOCKET") or "ray" not in sys.modules:
        return None
    from . import ray as on_ray

    return on_ray.socket_if_initialized()


def _converter(output: str, copy: bool) -> Callable[[Any], Any]:
    if output == "torch":
        try:
            import torch
        except ImportError:
            raise InvalidArgument(
                "output='torch' needs PyTorch: pip install torch, or use output='numpy'"
            ) from None
        if copy:
            return lambda field: torch.from_dlpack(field).clone()
        return torch.from_dlpack
    if output == "numpy":
        import numpy

        def to_numpy(field: Any) -> Any:
            array = numpy.from_dlpack(field)
            if copy:
                return array.copy()
            # numpy < 2.1 does not read DLPack's read-only flag; the arena is
            # mapped read-only anyway, so say so before a write faults.
            if array.flags.writeable:
                array.flags.writeable = False
            return array

        return to_numpy
    raise InvalidArgument(f"output={output!r}: use 'torch' or 'numpy'")


def _device(device: Any) -> str:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int N, or a ``torch.device``."""
    if isinstance(device, bool):
        raise InvalidArgument(f"device={device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device).strip()
    if text == "cuda":
        # As in torch: the current device (set with torch.cuda.set_device).
        torch = sys.modules.get("torch")
        index = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
        return f"cuda:{index}"
    return text


def _integer(name: str, value: Any) -> int:
    """``value`` as the native module takes it: an ``int`` (not a bool). The
    rules on its range are the Rust client's (``ConsumerOptions``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r} must be an integer")
    return value


def _count(name: str, value: Any) -> int:
    """An integer ≥ 0 (the Rust client checks the rest)."""
    n = _integer(name, value)
    if n < 0:
        raise InvalidArgument(f"{name}={n} must be ≥ 0")
    return n


def _state(state: Any) -> Optional[Dict[str, Any]]:
    """A state dict as the native module takes it."""
    if state is None:
        return None
    if not isinstance(state, dict):
        raise InvalidArgument(
            f"state must be the dict consumer.state_dict() returned, not {type(state).__name__}"
        )
    return state


def _position(p: Any) -> Optional[Tuple[int, int]]:
    """A resume position as the native module takes it."""
    if p is None:
        return None
    try:
        epoch, sample = p
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, sample)):
            return (epoch, sample)
    except (TypeError, ValueError):
        pass
    raise InvalidArgument(f"resume={p!r} must be (epoch, sample): two integers ≥ 0, as batch.next_position gives")


class Batch:
    """One batch in shared memory.

    Unpacks like the tuple a DataLoader yields (``images, labels = batch``),
    or, with ``as_dict=True``, behaves like a dict of field name to tensor.
    ``batch["name"]`` works either way. Tensors are views of shared memory:
    nothing is copied, and they are read-only (a write raises, or faults,
    instead of changing what other trainers read).

    The slot goes back to the broker when this object and every tensor made
    from it are gone. ``release()`` (or leaving a ``with batch:`` block)
    gives up this object's claim at once; using the batch afterwards raises
    :class:`batchcast.BatchReleased`, while tensors taken earlier stay valid
    and keep the slot until they die.
    """

    __slots__ = ("_raw", "_owner", "_cache")

    def __init__(self, raw: Any, owner: "Consumer") -> None:
        self._raw = raw
        self._owner = owner
        self._cache: Dict[int, Any] = {}

    # -- metadata ---------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._raw.epoch

    @property
    def index(self) -> int:
        """Position of the batch in its epoch."""
        return self._raw.index

    @property
    def seq(self) -> int:
        """Position of the batch in the stream."""
        return self._raw.seq

    @property
    def samples(self) -> int:
        """Valid samples (the batch size, or fewer for a short last batch)."""
        return self._raw.samples

    @property
    def first_sample(self) -> int:
        """Its first sample's place in the epoch's order."""
        return self._raw.first_sample

    @property
    def replayed(self) -> bool:
        """Recomputed for this trainer alone (``join="now"``, ``resume``);
        the bytes are those the shared stream carried."""
        return self._raw.replayed

    @property
    def next_position(self) -> Tuple[int, int]:
        """``(epoch, sample)`` right after this batch: save it with a
        checkpoint and pass it as ``Consumer(resume=...)`` to go on there.
        In an epoch read rotated (a late or replayed trainer on a decoupled
        stream) a position alone does not say the epoch's start is still
        to come: save :meth:`Consumer.state_dict`, which does."""
        return self._raw.next_position

    @property
    def wait_s(self) -> float:
        """Seconds the consumer was blocked waiting for this batch."""
        return self._raw.wait_s

    @property
    def released(self) -> bool:
        return self._raw.released

    # -- fields -----------------------------------------------------------
    def _tensor(self, i: int) -> Any:
        t = self._cache.get(i)
        if t is None:
            t = self._owner._convert(self._raw.field(i))
            self._cache[i] = t
        return t

    def host(self, key: Union[int, str]) -> Any:
        """Field ``key`` as a read-only numpy array over the batch's host
        shared memory (whatever tensor type the consumer converts to). Host
        batches only: a ``device="cuda:N"`` batch's host slot is given back
        once it is copied to the GPU, so this raises ``InvalidArgument``
        there (use ``tensor.cpu()``).
        """
        import numpy

        owner = self._owner
        i = owner._index_of.get(key) if isinstance(key, str) else owner._positional[key]
        if i is None:
            raise KeyError(f"no field {key!r} in stream {owner.stream!r}; it has {owner._names}")
        array = numpy.from_dlpack(self._raw.field(i, host=True))
        if array.flags.writeable:
            array.flags.writeable = False
        return array

    def __getitem__(self, key: Union[int, str]) -> Any:
        owner = self._owner
        if isinstance(key, str):
            i = owner._index_of.get(key)
            if i is None:
                raise KeyError(
                    f"no field {key!r} in stream {owner.stream!r}; it has {list(owner._index_of)}"
                )
            return self._tensor(i)
        if isinstance(key, int):
            return self._tensor(owner._positional[key])
        raise TypeError(f"index a batch with a field name or position, not {type(key).__name__}")

    def __iter__(self) -> Iterator[Any]:
        if self._owner.as_dict:
            return iter(self._owner._names)
        return (self._tensor(i) for i in self._owner._positional)

    def __len__(self) -> int:
        owner = self._owner
        return len(owner._names) if owner.as_dict else len(owner._positional)

    def keys(self) -> List[str]:
        return list(self._owner._names)

    def values(self) -> List[Any]:
        return [self._tensor(i) for i in range(len(self._owner._names))]

    def items(self) -> List[Tuple[str, Any]]:
        return [(n, self._tensor(i)) for i, n in enumerate(self._owner._names)]

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.items())

    # -- release ----------------------------------------------------------
    def release(self) -> None:
        """Gives the batch back now (see the class documentation)."""
        self._cache.clear()
        self._raw.release()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.samples} samples"
        return f"<batchcast.Batch epoch {self.epoch} index {self.index}: {state}>"


class Consumer:
    """Subscribes to a stream of a batchcast broker.

    Iterating yields the batches of one epoch, like a DataLoader::

        consumer = batchcast.Consumer(stream="train")
        for epoch in range(epochs):
            for images, labels in consumer:
                ...

    ``len(consumer)`` is the number of batches per epoch. Each batch is a
    :class:`Batch` whose fields arrive as torch tensors (``output="torch"``)
    or numpy arrays (``output="numpy"``) made through DLPack over the shared
    memory, without a copy.

    Arguments:
        stream: the stream's name in the broker's config (or the name a
            producer registered).
        socket: the broker's socket; default ``$BATCHCAST_SOCKET``, else
            in a Ray worker after ``batchcast.ray.init()`` the broker of its
            node (started on first use), else
            ``$XDG_RUNTIME_DIR/batchcast.sock``, else
            ``/tmp/batchcast-$UID/batchcast.sock``.
        window: most batches the program may hold (not yet released) at
            once. Holding a whole window makes the next wait block until a
            batch is released (from another thread, or by the garbage
            collector); after a few seconds a ``WindowFullWarning`` says so.
        join: ``"next-epoch"`` (the first epoch seen is complete),
            ``"immediate"`` (start with the next batch; that first epoch is
            partial) or ``"now"`` (start at once with a complete epoch: the
            part of the epoch in progress already published is recomputed
            for this trainer alone, byte for byte, then it reads the shared
            stream; streams an external producer feeds cannot do this).
            Default ``$BATCHCAST_JOIN`` (``batchcast launch`` sets it from
            a trainer's ``join`` key), else ``"next-epoch"``.
        output: ``"torch"`` or ``"numpy"``.
        as_dict: make each batch behave as a dict of name to tensor.
        fields: the fields a batch unpacks to, by name; default every field
            except metadata ones (an image stream's ``index``).
        name: shown in ``batchcast stats``.
        connect_timeout: seconds to keep retrying while the broker or the
            stream is not up yet; default ``$BATCHCAST_CONNECT_TIMEOUT`` or 0.
        device: where batches arrive: ``"cpu"`` (shared host memory), or
            ``"cuda:N"`` / a ``torch.device``: the broker copies each batch
            once into GPU N's memory and every consumer on that GPU gets
            tensors over the same device memory (CUDA IPC), with no copy of
            its own. The copy has finished before a batch is handed over, so
            it can be used on any CUDA stream; its slot goes back to the
            broker once the work queued on the stream it was imported on has
            finished. Device memory cannot be made read-only: never write to
            these tensors (use ``copy=True`` to get private ones).
        copy: give each trainer private, writable copies of the fields
            (costs one copy per field per batch; the slot is free as soon as
            the batch object is gone).
        broker_uid: the uid the broker must run as; default
            ``$BATCHCAST_BROKER_UID``, else this process's own. A socket
            served by any other user is refused (it could be an impostor).
        batch_size: this trainer's own batch size; default the stream's.
            Trainers of one stream may each ask for a different one: every
            trainer still gets every sample of every epoch once, in the
            stream's order, and each field of a batch is still one view of
            the shared memory, not a copy. The broker refuses sizes its
            slots cannot hold (the message says the largest it can).
        drop_last: drop each epoch's last batch when it is short, as
            ``DataLoader(drop_last=True)``; default the stream's
            ``drop_last`` (False unless its config says). The stream makes
            every sample of every epoch: what is dropped is this trainer's
            choice alone.
        resume: ``(epoch, sample)`` to start at instead of joining: a
            trainer restarting from a checkpoint passes the
            ``batch.next_position`` of the last batch it trained on. What
            the stream already published from there is replayed; a position
            ahead of the stream is waited for.
        state: a dict from :meth:`state_dict` (a checkpoint's): go on
            exactly where that consumer was, on its stream (in place of
            ``stream``) with its batch size unless ``batch_size`` is given.
            Not with ``resume``.
        reconnect_timeout: when the broker goes away (killed, restarted,
            upgraded), wait this many seconds for it to come back and go on
            from this trainer's next position: no error, the batches it
            holds still readable, every sample still once, in order, the
            same bytes (what the new broker's stream has not reached or has
            passed is recomputed). One line on stderr says it waits; Ctrl-C
            still interrupts the wait. ``0``: fail at once with
            ``BrokerUnavailable``. Default ``$BATCHCAST_RECONNECT_TIMEOUT``,
            else 60.
        group: take a seat in this group (a data-parallel trial's ranks):
            its members split each epoch among them, every sample once
            across the group and every rank as many batches (see
            docs/python-client.md, "Groups"); other consumers still read
            everything. Members share one batch size. Default
            ``$BATCHCAST_GROUP`` (its rank and world from the environment;
            refused if that has none).
        rank, world: this member's rank and the group's size; default
            torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else Slurm's
            ``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``.
        replicate: consecutive ranks that read the same samples (tensor-
            or sequence-parallel peers); must divide ``world``.

    Blocking waits release the GIL and answer Ctrl-C within about 50 ms.
    """

    def __init__(
        self,
        stream: str = "train",
        socket: Optional[PathLike] = None,
        window: int = 2,
        join: Optional[str] = None,
        output: str = "torch",
        as_dict: bool = False,
        fields: Optional[Sequence[str]] = None,
        name: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        device: Any = "cpu",
        copy: bool = False,
        broker_uid: Optional[int] = None,
        batch_size: Optional[int] = None,
        drop_last: Optional[bool] = None,
        resume: Optional[Tuple[int, int]] = None,
        state: Optional[Dict[str, Any]] = None,
        reconnect_timeout: Optional[float] = None,
        group: Optional[str] = None,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        replicate: int = 1,
    ) -> None:
        if state is not None and resume is not None:
            raise InvalidArgument("give state= or resume=, not both (a state carries its position)")
        dev = _device(device)
        if output == "numpy" and dev != "cpu":
            raise InvalidArgument(
                f"output='numpy' cannot hold GPU memory (device={dev!r}); use output='torch' or device='cpu'"
            )
        self._convert = _converter(output, bool(copy))
        self.output = output
        self.copy = bool(copy)
        self.as_dict = bool(as_dict)
        self.stream = stream
        self._fields = None if fields is None else list(fields)
        timeout = _env_timeout() if connect_timeout is None else float(connect_timeout)
        # What a load_state_dict() subscribes with again, its state aside.
        self._args: Dict[str, Any] = dict(
            socket=_default_socket(socket),
            window=_integer("window", window),
            join=join if join is not None else (os.environ.get("BATCHCAST_JOIN") or "next-epoch"),
            name=name,
            connect_timeout=timeout,
            device=dev,
            broker_uid=broker_uid,
            batch_size=None if batch_size is None else _integer("batch_size", batch_size),
            drop_last=None if drop_last is None else bool(drop_last),
            reconnect_timeout=None if reconnect_timeout is None else float(reconnect_timeout),
            group=group,
            rank=None if rank is None else _count("rank", rank),
            world=None if world is None else _count("world", world),
            replicate=_count("replicate", replicate),
        )
        self._attach(_native.Consumer(stream, resume=_position(resume), state=_state(state), **self._args))

    def _attach(self, native: Any) -> None:
        """Takes ``native`` (a new subscription) as this consumer's."""
        self._native = native
        self.stream = native.state()["stream"]
        fields = self._fields
        kind, index = self._native.device
        #: ``"cpu"`` or ``"cuda:N"``: where this consumer's batches live.
        self.device: str = "cpu" if kind == 1 else f"cuda:{index}"
        self.schema: Dict[str, Any] = self._native.schema()
        self._names: List[str] = [f["name"] for f in self.schema["fields"]]
        self._index_of: Dict[str, int] = {n: i for i, n in enumerate(self._names)}
        if fields is None:
            self._positional = [i for i, f in enumerate(self.schema["fields"]) if not f["aux"]]
        else:
            missing = [f for f in fields if f not in self._index_of]
            if missing:
                raise InvalidArgument(
                    f"fields {missing} are not in stream {self.stream!r}; it has {self._names}"
                )
            self._positional = [self._index_of[f] for f in fields]
        #: The uid the stream belongs to: the broker's for a configured
        #: stream, its producer's for a registered one.
        self.owner_uid: int = self._native.owner_uid
        #: The epoch the next batch belongs to.
        self.epoch: int = self._native.start_epoch
        self._ended = False
        self._batches = 0
        self._wait_s = 0.0
        self._busy_s = 0.0
        self._last_return: Optional[float] = None
        self._warned = False

    # -- checkpoints -------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This trainer's place in its stream, for its checkpoint (the
        convention of torchdata's ``StatefulDataLoader``): a small dict of
        plain values (``json.dumps`` takes it) saying where its next batch
        begins, right after the last batch this consumer handed out, with
        its batch size and the stream's digest. Free: no message is sent.

        Save it with the model after training on a batch; pass it back as
        ``Consumer(state=...)`` or to :meth:`load_state_dict` to go on
        exactly there, even after the broker restarted (what the stream
        made meanwhile is recomputed). A broker whose stream now makes
        other data refuses it (``StreamError``, code ``StreamChanged``),
        naming what changed."""
        return dict(self._native.state())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Goes on from ``state`` (from :meth:`state_dict`): subscribes again
        there, with this consumer's other arguments (its batch size unless
        it gave one: then the state's samples are grouped in its own).
        Batches it holds stay readable."""
        self._attach(_native.Consumer(self.stream, state=_state(state), **self._args))

    # -- what the stream is ----------------------------------------------
    @property
    def classes(self) -> List[str]:
        """Class names in label order, where the source knows them."""
        return list(self.schema["classes"])

    @property
    def batch_size(self) -> int:
        """This trainer's batch size (its own, or the stream's)."""
        return self._native.batch_size

    @property
    def window(self) -> int:
        return self._native.window

    @property
    def held(self) -> int:
        """Batches received and not yet given back."""
        return self._native.held

    @property
    def reconnects(self) -> int:
        """Times it subscribed again after its broker went away (each
        time it went on from its next position; see ``reconnect_timeout``)."""
        return self._native.reconnects

    @property
    def arena(self) -> Tuple[int, int]:
        """``(address, length)`` of the shared memory in this process."""
        return self._native.arena

    @property
    def ended(self) -> bool:
        """True once the stream's last batch has been delivered (or the
        stream ended early): iterating gives nothing more."""
        return self._ended

    def __len__(self) -> int:
        return self._native.batches_per_epoch

    # -- iteration --------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch
            # Not held here while waiting for the next one: a batch the
            # program dropped must not count against its window.
            del batch

    def next_batch(self) -> Optional[Batch]:
        """The next batch of the current epoch, or ``None`` at the end of
        the epoch (or of the stream)."""
        if self._ended:
            return None
        start = time.perf_counter()
        if self._last_return is not None:
            self._busy_s += start - self._last_return
        waited_since = start
        while True:
            event = self._native.next_event(2.0)
            if event is not None:
                break
            if not self._warned and self._native.held >= self._native.window:
                self._warned = True
                warnings.warn(
                    f"batchcast consumer of {self.stream!r} holds all {self._native.window} batches "
                    f"of its window and has waited {time.perf_counter() - waited_since:.0f} s for "
                    "another; it waits until one is released. Drop or release() batches you are "
                    "done with, or pass a larger window=",
                    WindowFullWarning,
                    stacklevel=3,
                )
        kind = event[0]
        now = time.perf_counter()
        if kind == "batch":
            raw = event[1]
            self.epoch = raw.epoch
            self._batches += 1
            self._wait_s += now - start
            self._last_return = now
            # The stream's last batch: nothing follows but its end markers,
            # so `ended` is true from now on (as documented), not only after
            # one more call. In the consumer's order: a rotated last epoch
            # ends with its start, so its position says, not the index.
            epochs = self.schema["epochs"]
            if epochs is not None and raw.epoch == epochs - 1:
                state = self._native.state()
                if ("rotated_at" not in state and raw.index == self._native.batches_per_epoch - 1) or state[
                    "epoch"
                ] == epochs:
                    self._ended = True
            return Batch(raw, self)
        self._last_return = None
        if kind == "epoch_end":
            self.epoch = event[1] + 1
        else:
            self._ended = True
        return None

    # -- statistics -------------------------------------------------------
    def stats(self) -> Dict[str, float]:
        """Wait-time statistics of this consumer: ``wait_s`` (blocked waiting
        for data), ``busy_s`` (between getting a batch and asking for the
        next: the training step), and ``stall_fraction`` =
        wait / (wait + busy), the share of time the trainer starved."""
        total = self._wait_s + self._busy_s
        return {
            "batches": self._batches,
            "wait_s": self._wait_s,
            "busy_s": self._busy_s,
            "stall_fraction": self._wait_s / total if total > 0 else 0.0,
        }

    def __repr__(self) -> str:
        return (
            f"<batchcast.Consumer stream={self.stream!r} epoch={self.epoch} "
            f"batches/epoch={len(self)} window={self.window} output={self.output!r} "
            f"device={self.device!r}>"
        )
