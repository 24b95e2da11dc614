"""A batch in shared memory, its fields as tensors or arrays without a
copy."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

from .errors import InvalidArgument


def converter(output: str, copy: bool) -> Callable[[Any], Any]:
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

    def __init__(self, raw: Any, owner: Any) -> None:
        # owner: the Consumer that received it (its converter, field names
        # and order), typed loosely so this module need not import it.
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
