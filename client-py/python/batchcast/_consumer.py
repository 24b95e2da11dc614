"""The consumer: batches of a broker's stream as tensors, zero-copy."""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _native
from ._args import PathLike, default_socket
from ._batch import Batch, converter
from .errors import InvalidArgument, WindowFullWarning


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
            producer registered); default ``$BATCHCAST_STREAM``, else
            ``"train"``.
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
        name: shown in ``batchcast stats`` and the live table; default
            ``$BATCHCAST_NAME`` (``batchcast launch`` sets it), else the
            program's name.
        connect_timeout: seconds to keep retrying while the broker or the
            stream is not up yet; default ``$BATCHCAST_CONNECT_TIMEOUT`` or 0.
        device: where batches arrive: ``"cpu"`` (shared host memory, the
            default unless ``$BATCHCAST_DEVICE`` says otherwise), or
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
        batch_size: this trainer's own batch size; default
            ``$BATCHCAST_BATCH_SIZE``, else the stream's.
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
        stream: Optional[str] = None,
        socket: Optional[PathLike] = None,
        window: int = 2,
        join: Optional[str] = None,
        output: str = "torch",
        as_dict: bool = False,
        fields: Optional[Sequence[str]] = None,
        name: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        device: Any = None,
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
        # Every default left as None is the native client's: it reads the
        # environment (batchcast.options' table says which variable).
        dev = None if device is None else _device(device)
        if output == "numpy" and dev not in (None, "cpu"):
            raise InvalidArgument(
                f"output='numpy' cannot hold GPU memory (device={dev!r}); use output='torch' or device='cpu'"
            )
        self._convert = converter(output, bool(copy))
        self.output = output
        self.copy = bool(copy)
        self.as_dict = bool(as_dict)
        self._fields = None if fields is None else list(fields)
        # What a load_state_dict() subscribes with again, its state aside.
        self._args: Dict[str, Any] = dict(
            socket=default_socket(socket),
            window=window,
            join=join,
            name=name,
            connect_timeout=None if connect_timeout is None else float(connect_timeout),
            device=dev,
            broker_uid=broker_uid,
            batch_size=batch_size,
            drop_last=None if drop_last is None else bool(drop_last),
            reconnect_timeout=None if reconnect_timeout is None else float(reconnect_timeout),
            group=group,
            rank=rank,
            world=world,
            replicate=replicate,
        )
        self._attach(_native.Consumer(stream, resume=resume, state=state, **self._args))

    def _attach(self, native: Any) -> None:
        """Takes ``native`` (a new subscription) as this consumer's."""
        kind, index = native.device
        if self.output == "numpy" and kind != 1:
            # Dropping the subscription (the last reference) leaves it.
            raise InvalidArgument(
                f"output='numpy' cannot hold GPU memory ($BATCHCAST_DEVICE gave cuda:{index}); use output='torch' or device='cpu'"
            )
        self._native = native
        self.stream = native.state()["stream"]
        fields = self._fields
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
        self._attach(_native.Consumer(self.stream, state=state, **self._args))

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
