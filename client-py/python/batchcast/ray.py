"""batchcast on a Ray cluster: one broker per node, shared by every trial
placed there.

On the driver, after ``ray.init()``::

    import batchcast.ray
    batchcast.ray.init(config="broker.toml")   # or the TOML text

and a trainable only calls ``batchcast.Consumer(stream=...)``: the first
consumer (or :func:`socket`) on a node starts that node's broker, in a
detached actor pinned to the node, and every later one on the node finds it.
The brokers live as long as the cluster (or until :func:`shutdown`); a
broker dies with its actor's process (the actor is its parent and the broker
gets SIGTERM when it goes).

:func:`feed` runs a :class:`batchcast.Producer` over a Ray Data dataset on
one node, so a stream can be made on the cluster's CPU nodes and handed to
that node's trainers through its broker, once for all of them;
:func:`feed_stream` does the same with a configured stream's own pipeline
(``batchcast make`` on each CPU node, ``batchcast feed`` on the fed one),
the stream's exact epochs.

Who may do what: the brokers run as the user Ray's workers run as, with
sockets in a directory only that user can enter; anything that can call
into the cluster (submit jobs or tasks) can already run code as that user.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ._exe import executable
from .errors import BrokerUnavailable, InvalidArgument

#: The Ray namespace of batchcast's named actors (shared by every job).
NAMESPACE = "batchcast"
_REGISTRY = "batchcast-config"
_PREFIX = "batchcast-broker-"
_START_TIMEOUT = 60.0


def _directory(node_id: str) -> Path:
    """Where a node's broker keeps its socket, config and log. Node ids are
    unique per cluster, so simulated nodes sharing one /tmp do not meet."""
    base = Path(os.environ.get("BATCHCAST_RAY_DIR") or f"/tmp/batchcast-ray-{os.getuid()}")
    return base / node_id[:16]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # PR_SET_PDEATHSIG: the broker gets SIGTERM when the actor's process
    # (the thread that started it: Ray runs a plain actor's methods on its
    # main thread) goes, whether killed, crashed or stopped with the cluster.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


@ray.remote(num_cpus=0)
class _Registry:
    """Holds the broker config :func:`init` was given, for nodes whose
    broker starts later."""

    def __init__(self, config: str, metrics: Optional[str]) -> None:
        self.config = config
        self.metrics = metrics

    def get(self) -> Dict[str, Any]:
        return {"config": self.config, "metrics": self.metrics}


@ray.remote(num_cpus=0)
class _NodeBroker:
    """One node's broker process; the actor is pinned to that node."""

    def __init__(self, config: str, metrics: Optional[str]) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        d = _directory(self.node_id)
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        os.chmod(d.parent, 0o700)
        self.socket_path = str(d / "broker.sock")
        self.log = d / "broker.log"
        cfg = d / "broker.toml"
        cfg.write_text(config)
        args = [executable(), "serve", "--config", str(cfg), "--socket", self.socket_path]
        if metrics:
            args += ["--metrics", metrics]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),
            preexec_fn=_die_with_parent,
        )
        self._wait_up()

    def _wait_up(self) -> None:
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise BrokerUnavailable(
                    f"the broker on Ray node {self.node_id} exited with {code} at start; its log "
                    f"({self.log}) ends:\n{tail}"
                )
            r = subprocess.run(
                [executable(), "stats", "--json", "--socket", self.socket_path],
                capture_output=True,
            )
            if r.returncode == 0:
                return
            if time.monotonic() - t0 > _START_TIMEOUT:
                raise BrokerUnavailable(
                    f"the broker on Ray node {self.node_id} did not answer on {self.socket_path} "
                    f"within {_START_TIMEOUT:.0f} s; see {self.log}"
                )
            time.sleep(0.05)

    def info(self) -> Dict[str, Any]:
        return {
            "node_id": self.node_id,
            "socket": self.socket_path,
            "pid": self.proc.pid,
            "log": str(self.log),
            "alive": self.proc.poll() is None,
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _config_text(config: Union[str, os.PathLike, None]) -> str:
    if config is None:
        return ""
    if isinstance(config, os.PathLike) or ("\n" not in str(config) and Path(str(config)).is_file()):
        return Path(config).read_text()
    text = str(config)
    if "\n" not in text and text.endswith(".toml"):
        raise InvalidArgument(f"batchcast.ray.init: no config file {text!r}")
    return text


def init(config: Union[str, os.PathLike, None] = None, metrics: Optional[str] = None) -> None:
    """Sets the config every node's broker serves: a TOML file's path or its
    text (``None``: no configured stream; producers register theirs, as with
    :func:`feed`). Call on the driver after ``ray.init()``, before trials
    start; brokers already running keep theirs (call :func:`shutdown` first
    to change it). ``metrics``: each broker's ``--metrics`` address (give
    port 0 on a cluster of simulated nodes sharing one host)."""
    text = _config_text(config)
    try:
        registry = ray.get_actor(_REGISTRY, namespace=NAMESPACE)
        ray.kill(registry)
    except ValueError:
        pass
    _Registry.options(name=_REGISTRY, namespace=NAMESPACE, lifetime="detached").remote(text, metrics)


def initialized() -> bool:
    """Whether :func:`init` was called on this Ray cluster."""
    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(_REGISTRY, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def _broker(node_id: str) -> Any:
    try:
        return ray.get_actor(_PREFIX + node_id, namespace=NAMESPACE)
    except ValueError:
        pass
    try:
        registry = ray.get_actor(_REGISTRY, namespace=NAMESPACE)
    except ValueError:
        raise BrokerUnavailable(
            "no broker on this Ray node and batchcast.ray.init() was not called on this cluster: "
            "call it on the driver after ray.init()"
        ) from None
    setup = ray.get(registry.get.remote())
    # get_if_exists: of trials racing to start the node's broker, one does.
    return _NodeBroker.options(
        name=_PREFIX + node_id,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(setup["config"], setup["metrics"])


def socket(node_id: Optional[str] = None) -> str:
    """The socket of the broker on ``node_id`` (default: the node this
    runs on), starting it there first if it is not running."""
    if not ray.is_initialized():
        raise BrokerUnavailable("batchcast.ray.socket(): Ray is not initialised (call ray.init())")
    node = node_id or ray.get_runtime_context().get_node_id()
    return ray.get(_broker(node).info.remote())["socket"]


def brokers() -> Dict[str, Dict[str, Any]]:
    """The brokers running on this cluster, by node id: each one's socket,
    pid, log and whether its process is alive."""
    found: Dict[str, Dict[str, Any]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"] if isinstance(actor, dict) else actor
        ns = actor.get("namespace") if isinstance(actor, dict) else NAMESPACE
        if ns == NAMESPACE and name.startswith(_PREFIX):
            try:
                info = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote())
            except (ValueError, ray.exceptions.RayActorError):
                continue  # stopped meanwhile
            found[info["node_id"]] = info
    return found


def shutdown() -> None:
    """Stops every node's broker and forgets the config."""
    for node in brokers():
        try:
            actor = ray.get_actor(_PREFIX + node, namespace=NAMESPACE)
            ray.get(actor.stop.remote())
            ray.kill(actor)
        except (ValueError, ray.exceptions.RayActorError):
            pass
    try:
        ray.kill(ray.get_actor(_REGISTRY, namespace=NAMESPACE))
    except ValueError:
        pass


def socket_if_initialized() -> Optional[str]:
    """For :class:`batchcast.Consumer` and :class:`batchcast.Producer`
    in a Ray worker: this node's broker socket when :func:`init` was called
    on the cluster, else ``None`` (the usual default socket)."""
    if not initialized():
        return None
    return socket()


class _DatasetBatches:
    """A Ray Data dataset (or a streaming split's iterator) seen as a
    loader: one pass per epoch, its batches as dicts of numpy arrays,
    ``len()`` batches each pass."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool, prefetch: int, rows: int) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.batches = rows // batch_size if drop_last else -(-rows // batch_size)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        # Ray Data does not keep order by default, so its short batch may
        # come anywhere in a pass; a stream's epoch may end with one only.
        # Short batches are held back and joined (a copy of their rows
        # alone); what remains at the end of the pass comes last.
        carry: Optional[Dict[str, Any]] = None
        for batch in self.dataset.iter_batches(
            batch_size=self.batch_size,
            batch_format="numpy",
            drop_last=self.drop_last,
            prefetch_batches=self.prefetch,
        ):
            rows = len(next(iter(batch.values())))
            if rows == self.batch_size:
                yield batch
                continue
            carry = batch if carry is None else {k: numpy.concatenate([carry[k], batch[k]]) for k in batch}
            while len(next(iter(carry.values()))) >= self.batch_size:
                yield {k: v[: self.batch_size] for k, v in carry.items()}
                carry = {k: v[self.batch_size :] for k, v in carry.items()}
        if carry is not None and len(next(iter(carry.values()))) > 0:
            yield carry


@ray.remote(num_cpus=0)
class _Executor:
    """Holds a streaming split of a dataset, so that Ray Data's executor
    (its coordinator runs on the node that splits) runs on this actor's
    node rather than on the fed one."""

    def split(self, dataset: Any) -> Any:
        return dataset.streaming_split(1, equal=False)[0]


@ray.remote(num_cpus=0)
def _feed(dataset: Any, options: Dict[str, Any]) -> Dict[str, float]:
    from ._producer import Producer

    rows = options.pop("rows")
    executor_node = options.pop("executor_node")
    if rows is None:
        rows = dataset.count()
    source, executor = dataset, None
    if executor_node is not None and executor_node != ray.get_runtime_context().get_node_id():
        # Owned by this task: it goes when the feed ends.
        executor = _Executor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=executor_node, soft=False)
        ).remote()
        source = ray.get(executor.split.remote(dataset))
    loader = _DatasetBatches(source, options.pop("batch_size"), options.pop("drop_last"), options.pop("prefetch"), rows)
    epochs = options.pop("epochs")
    if options.get("socket") is None:
        options["socket"] = socket()
    before = resource.getrusage(resource.RUSAGE_SELF)
    figures = Producer(loader, **options).run(epochs=epochs)
    after = resource.getrusage(resource.RUSAGE_SELF)
    # The feed's cost on this node: Ray Data's executor unless it runs
    # elsewhere, the iterator (pulling blocks, batching) and the copy into
    # the stream's ring.
    figures["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    del executor
    return figures


def feed(
    dataset: Any,
    stream: str,
    batch_size: int,
    epochs: Optional[int] = None,
    node_id: Optional[str] = None,
    drop_last: bool = False,
    prefetch: int = 4,
    rows: Optional[int] = None,
    executor_node: Optional[str] = None,
    **producer: Any,
) -> "ray.ObjectRef":
    """Feeds stream ``stream`` of the broker on ``node_id`` (default: the
    node this runs on) with a Ray Data ``dataset``: a task pinned to that
    node runs a :class:`batchcast.Producer` over its batches (numpy), one
    pass per epoch, while Ray Data runs the dataset's own work (reads,
    ``map_batches``) on whatever CPUs of the cluster it schedules them on.
    Every trainer of that node subscribes to ``stream`` as usual.

    ``executor_node``: where Ray Data's streaming executor runs. By default
    in the feed task, on the fed node, where it costs about as much CPU as
    decoding (measured: bench/ray_data.py); give another node's id to run
    it there (the dataset is read through a ``streaming_split`` whose
    coordinator lives on that node), leaving the fed node only the
    iterator and the copy into the ring.

    Ray Data's order is its own (set
    ``DataContext.execution_options.preserve_order`` for a fixed one); a
    short batch comes last in each epoch. ``rows``: the dataset's rows per
    pass, when known (else ``dataset.count()``, which runs a pipeline whose
    row count its source does not give once more). ``producer``: further
    :class:`batchcast.Producer` arguments (``slots``, ``min_consumers``,
    ``lag_limit``, ...). Returns the task's reference; ``ray.get`` it for
    the producer's figures, with ``cpu_s``, the CPU the feed task took."""
    if batch_size < 1:
        raise InvalidArgument(f"batch_size={batch_size} must be at least 1")
    node = node_id or ray.get_runtime_context().get_node_id()
    options = dict(
        producer,
        stream=stream,
        batch_size=batch_size,
        epochs=epochs,
        drop_last=drop_last,
        prefetch=prefetch,
        rows=rows,
        executor_node=executor_node,
    )
    return _feed.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
        dataset, options
    )


def _child_cpu_s(proc: subprocess.Popen) -> float:
    """Waits for ``proc`` and returns the CPU seconds it took (all its
    threads), from the kernel's accounting at its exit."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _describe(config: str, stream: str, wire: str) -> Dict[str, Any]:
    """``batchcast make --schema`` on this node (where the dataset is)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="batchcast-make-") as d:
        cfg = Path(d) / "stream.toml"
        cfg.write_text(config)
        r = subprocess.run(
            [executable(), "make", "--config", str(cfg), "--stream", stream, "--schema", "--wire", wire],
            capture_output=True,
            text=True,
        )
    if r.returncode != 0:
        node = ray.get_runtime_context().get_node_id()
        raise InvalidArgument(f"batchcast make on Ray node {node}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def _make(config: str, stream: str, workers: int, address: str, token: str, wire: str) -> Dict[str, Any]:
    """``batchcast make --connect`` on this node: the stream's own pipeline
    making what the feed at ``address`` asks for, until it is done."""
    import json
    import tempfile

    node = ray.get_runtime_context().get_node_id()
    with tempfile.TemporaryDirectory(prefix="batchcast-make-") as d:
        cfg = Path(d) / "stream.toml"
        cfg.write_text(config)
        log = Path(d) / "make.log"
        proc = subprocess.Popen(
            [executable(), "make", "--config", str(cfg), "--stream", stream, "--workers", str(workers),
             "--connect", address, "--wire", wire],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),
            env={**os.environ, "BATCHCAST_FEED_TOKEN": token},
            preexec_fn=_die_with_parent,
        )
        out = proc.stdout.read() if proc.stdout else b""
        cpu_s = _child_cpu_s(proc)
        said = log.read_text(errors="replace").strip()
    if proc.returncode != 0:
        raise BrokerUnavailable(f"batchcast make on Ray node {node} failed ({proc.returncode}): {said[-2000:]}")
    made = json.loads(out.decode().strip().splitlines()[-1])
    return {"node_id": node, "cpu_s": cpu_s, **made}


@ray.remote(num_cpus=0)
def _feed_stream(config: str, stream: str, options: Dict[str, Any]) -> Dict[str, Any]:
    import json
    import secrets
    import tempfile

    makers = options.pop("makers")
    pins = {n: NodeAffinitySchedulingStrategy(node_id=n, soft=False) for n, _ in makers}
    first = makers[0][0]
    wire = options["wire"]
    described = ray.get(
        ray.remote(num_cpus=0)(_describe).options(scheduling_strategy=pins[first]).remote(config, stream, wire)
    )
    token = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix="batchcast-feed-") as d:
        schema = Path(d) / "schema.json"
        schema.write_text(json.dumps(described))
        args = [executable(), "feed", "--schema", str(schema), "--makers", str(len(makers)),
                "--listen", f"{ray.util.get_node_ip_address()}:0", "--socket", options["socket"] or socket(),
                "--in-flight", str(options["in_flight"])]
        for key in ("epochs", "per_request", "min_consumers"):
            if options.get(key) is not None:
                args += [f"--{key.replace('_', '-')}", str(options[key])]
        log = Path(d) / "feed.log"
        feed = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),
            env={**os.environ, "BATCHCAST_FEED_TOKEN": token},
            preexec_fn=_die_with_parent,
        )
        first_line = feed.stdout.readline().decode() if feed.stdout else ""
        if not first_line.startswith("listening "):
            feed.wait()
            raise BrokerUnavailable(f"batchcast feed did not start: {log.read_text(errors='replace')[-2000:]}")
        address = first_line.split()[1]
        made = [
            ray.remote(_make)
            .options(num_cpus=workers, scheduling_strategy=pins[node])
            .remote(config, stream, workers, address, token, wire)
            for node, workers in makers
        ]
        out = feed.stdout.read() if feed.stdout else b""
        cpu_s = _child_cpu_s(feed)
        if feed.returncode != 0:
            for ref in made:
                ray.cancel(ref, force=True)
            raise BrokerUnavailable(f"batchcast feed failed: {log.read_text(errors='replace')[-2000:]}")
    figures: Dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    # The host's part: reading each batch into its slot (the kernel's copy).
    figures["cpu_s"] = cpu_s
    figures["makers"] = ray.get(made)
    return figures


def _cpu_nodes(fed: str) -> List[Tuple[str, int]]:
    """Every other alive node with CPUs, and how many it has."""
    return [
        (n["NodeID"], int(n["Resources"]["CPU"]))
        for n in ray.nodes()
        if n.get("Alive") and n["NodeID"] != fed and n.get("Resources", {}).get("CPU", 0) >= 1
    ]


def feed_stream(
    config: Union[str, os.PathLike],
    stream: str,
    epochs: Optional[int] = None,
    node_id: Optional[str] = None,
    nodes: Optional[List[str]] = None,
    workers: Optional[int] = None,
    per_request: Optional[int] = None,
    in_flight: int = 2,
    min_consumers: Optional[int] = None,
    socket_path: Optional[str] = None,
    wire: str = "auto",
) -> "ray.ObjectRef":
    """Feeds stream ``stream`` of the broker on ``node_id`` (default: the
    node this runs on) with batches that stream's own pipeline makes on the
    cluster's CPU nodes: ``config`` (a TOML file's path or its text) is the
    stream's config as its broker would have it, and each node in ``nodes``
    (default: every other alive node with CPUs) runs ``batchcast make`` on
    it with ``workers`` pipeline threads (default: the node's CPUs, all of
    them reserved), making a share of each epoch's batches. On the fed node,
    ``batchcast feed`` registers the stream with the broker as its producer
    and reads each batch from its maker's TCP connection straight into its
    slot, in the stream's order: every epoch is the stream's, sample for
    sample and byte for byte what its broker would make, whichever node
    made it (the dataset's paths must reach the same files from every
    making node). Makers connect to the fed node's Ray address with a
    token the feed made for them; nothing else gets in.

    ``epochs``: default the config's. ``per_request``: batches a node makes
    per request (default twice its threads); ``in_flight``: requests each
    node has ahead. ``min_consumers`` (default the config's): trainers the
    stream waits for. ``socket_path``: the fed node's broker (default: the
    one :func:`socket` finds or starts). ``wire``: ``"auto"`` (default)
    sends an image stream's float tensor as the ``u8`` pixels it is made
    from, which the feed widens through the stream's own table (the same
    bytes, a quarter of them on the network), where the stream allows it
    (no ``random_erasing``); ``"u8"`` insists, ``"as-is"`` sends the
    stream's bytes. Returns the task's reference;
    ``ray.get`` it for the figures: batches, samples, ``cpu_s`` (the feed's
    on the fed node), ``widened`` (pixels came as u8), ``wire_bytes`` and
    ``makers`` (each node's batches, samples and CPU)."""
    text = _config_text(config)
    if not text.strip():
        raise InvalidArgument("batchcast.ray.feed_stream: the config is empty; it must describe the stream")
    node = node_id or ray.get_runtime_context().get_node_id()
    known = dict(_cpu_nodes(node))
    chosen = list(known) if nodes is None else list(nodes)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise InvalidArgument(f"batchcast.ray.feed_stream: no alive node with CPUs other than the fed one: {unknown}")
    if not chosen:
        raise InvalidArgument(
            "batchcast.ray.feed_stream: the cluster has no other node with CPUs to make the stream on "
            "(serve the stream from the config on this node instead)"
        )
    if workers is not None and workers < 1:
        raise InvalidArgument(f"workers={workers} must be at least 1")
    if wire not in ("auto", "u8", "as-is"):
        raise InvalidArgument(f'wire={wire!r}: give "auto", "u8" or "as-is"')
    options = dict(
        makers=[(n, workers or known[n]) for n in chosen],
        epochs=epochs,
        per_request=per_request,
        in_flight=in_flight,
        min_consumers=min_consumers,
        socket=socket_path,
        wire=wire,
    )
    return _feed_stream.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
        text, stream, options
    )


__all__ = [
    "NAMESPACE",
    "brokers",
    "feed",
    "feed_stream",
    "init",
    "initialized",
    "shutdown",
    "socket",
    "socket_if_initialized",
]
