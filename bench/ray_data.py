"""A host's stream made by Ray Data on the cluster's CPU nodes: images/s
with 0, 1 and 2 remote CPU nodes added to the host's own CPU.

The host is a Ray node (the head of a local cluster, `--host-cpus` CPUs
for Ray) running its batchcast broker, the Producer that `batchcast.ray.feed`
pins there, and `--trainers` trainers reading the stream (numpy, a 2 ms
step each). The pipeline is Ray Data: read the JPEG files, decode and
augment in `map_batches` (Pillow: RandomResizedCrop(224) + horizontal flip,
Normalize to float32 NCHW), wherever Ray schedules its tasks. Remote CPU
nodes are simulated nodes of the same cluster (`ray.cluster_utils.Cluster`,
`--remote-cpus` CPUs each). The reference row is the broker's own pipeline
(native, `workers` = the host's CPUs) with no Ray Data.

images/s: the images one trainer gets per second, epoch 0 excluded (start
up, Ray Data's first tasks), the median of the trainers. `made remotely`:
the share of images whose map_batches task ran on a remote node. The
host's CPU-ms per image: in decode + augment (the map tasks that ran on the
host, by their process time), and in the feed task (its whole process:
Ray Data's streaming executor, which runs in the process iterating the
dataset, pulling blocks from other nodes, the iterator's batching, and the
Producer's copy into the stream's ring), over the images of the counted
epochs (the feed task: of all epochs).

Rows "executor on a remote node" pass `executor_node=` to
`batchcast.ray.feed`: Ray Data's streaming executor runs on the first
remote node (a streaming split held there) instead of in the feed task on
the host. Rows "the stream's own pipeline on N remote CPU nodes" feed the
same stream config (the reference row's) with `batchcast.ray.feed_stream`:
`batchcast make` on each remote node (its CPUs as pipeline threads), the
host only taking batches from Ray and copying them into the ring.

Table 2, where the CPU goes per image (of all epochs): the host's (its
broker process, the feed (Ray Data's feed task, or `batchcast feed`), and
Ray Data's map tasks that ran on the host), the host raylet's (Ray's
object transfers into the host), and the remote nodes'. Two remote
measures: the pipeline's own (Ray Data: its map tasks' decode + augment,
their process time inside the task, from epoch 1 on; feed_stream: the
`batchcast make` processes), and the remote nodes' whole CPU (their
raylets and every process below them: Ray's workers, read and map tasks,
the executor where it runs there, `batchcast make`) over the images made
there, over the whole run (starting Ray's worker processes included,
which a long run amortises: its share falls with the run's length).
"vs Ray Data's": the median of the Ray Data rows over this row's.

Table 3 splits the hand-off: Ray Data's iterator over a dataset already
in the object store, rebatched or as stored, and a plain copy of the same
bytes (the bound of the Producer's one copy into the ring, and of what a
native reader of Ray's object store would still have to copy).

On one machine the "remote" nodes share its cores: with 2 cores, host
(1 CPU) + 1 remote node uses both, a second remote node adds Ray tasks but
no core. The table shows the hand-off and the scheduling, not a cluster's
scaling; on real nodes each remote node brings its own cores.

    python bench/ray_data.py DATASET [--epochs 4] [--remote 0,1,2] [--native 1,2] [--prepared COPY]

`--prepared COPY` (`batchcast prepare DATASET COPY`: its JPEGs with
restart markers, the same pixels) adds the native rows on that copy, the
Ray Data rows staying on the dataset as it is.

Needs Ray with Ray Data (scripts/setup installs it) and the release broker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXE, image_stream, print  # noqa: E402,A004

os.environ.setdefault("BATCHCAST_BIN", EXE)

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import batchcast  # noqa: E402
import batchcast.ray  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)[:, None, None]

def augment(batch, nodes, dtype="f32"):
    """Decode and augment a batch of JPEG files, as torchvision's
    RandomResizedCrop(224) + RandomHorizontalFlip + Normalize would
    (`dtype="u8"`: uint8 pixels, not normalised)."""
    import io
    import math
    import random

    from PIL import Image

    here = nodes.index(ray.get_runtime_context().get_node_id())
    t0 = time.process_time()
    images = []
    for data in batch["bytes"]:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = im.size
        for _ in range(10):
            area = w * h * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:
            cw, ch = min(w, h), min(w, h)
            x, y = (w - cw) // 2, (h - ch) // 2
        im = im.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        if dtype == "u8":
            images.append(np.ascontiguousarray(np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)))
            continue
        a = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0
        images.append((a - MEAN) / STD)
    n = len(images)
    cpu_us = int((time.process_time() - t0) * 1e6 / n)
    return {"image": np.stack(images), "node": np.full(n, here, dtype=np.int64), "cpu_us": np.full(n, cpu_us)}


@ray.remote(num_cpus=0)
def trainer(stream: str, name: str):
    c = batchcast.Consumer(stream=stream, output="numpy", name=name, connect_timeout=120)
    marks, cpu_us = [], {"host": [0, 0], "remote": [0, 0]}  # where: [images, CPU-us]
    while not c.ended:
        n = 0
        for b in c:
            images = b["image"]
            if stream == "ray" and c.epoch > 0:
                on_host = b["node"] == 0
                for where, sel in (("host", on_host), ("remote", ~on_host)):
                    cpu_us[where][0] += int(sel.sum())
                    cpu_us[where][1] += int(b["cpu_us"][sel].sum())
            n += images.shape[0]
            time.sleep(0.002)  # the trainer's step
        marks.append((time.time(), n))
    return marks, cpu_us


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """CPU seconds of process ``root`` and every process below it, with
    what their children that exited took (a node's raylet: its workers,
    the tasks' own children)."""
    parents, times = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(d.name)] = int(f[1])
        times[int(d.name)] = sum(int(x) for x in f[11:15])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0)
        todo.extend(p for p, pp in parents.items() if pp == pid)
    return total / os.sysconf("SC_CLK_TCK")


def run(root: Path, mode: str, remote_nodes: int, a, executor_remote: bool = False) -> dict:
    """One row. ``mode``: "local" (the broker's own pipeline on the host),
    "ray" (Ray Data, batchcast.ray.feed) or "native" (the stream's own
    pipeline on the remote nodes, batchcast.ray.feed_stream)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": a.host_cpus, "include_dashboard": False})
    for _ in range(remote_nodes):
        cluster.add_node(num_cpus=a.remote_cpus)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    raylet = cluster.head_node.all_processes["raylet"][0].process.pid
    remote_raylets = [
        n.all_processes["raylet"][0].process.pid for n in cluster.list_all_nodes() if n is not cluster.head_node
    ]
    try:
        host = ray.get_runtime_context().get_node_id()
        nodes = [host] + [n["NodeID"] for n in ray.nodes() if n["NodeID"] != host and n["Alive"]]
        pin = NodeAffinitySchedulingStrategy(node_id=host, soft=False)
        files = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        config = image_stream(
            "native", root, a.batch, dtype=a.dtype, epochs=a.epochs, workers=a.host_cpus if mode == "local" else a.remote_cpus,
            min_consumers=a.trainers, seed=1, slots=8,
        )
        batchcast.ray.init(config if mode == "local" else None)
        broker = batchcast.ray.brokers().get(host) or {"pid": None}
        if broker["pid"] is None:
            batchcast.ray.socket(host)
            broker = batchcast.ray.brokers()[host]
        cpu0 = {
            "broker": _cpu_s(broker["pid"]),
            "raylet": _cpu_s(raylet),
            "remote": sum(_tree_cpu_s(p) for p in remote_raylets),
        }
        stream, fed = "native", None
        if mode == "ray":
            stream = "ray"
            ds = ray.data.read_binary_files(files, override_num_blocks=max(4, 4 * len(nodes)))
            ds = ds.map_batches(augment, batch_size=a.batch, fn_kwargs={"nodes": nodes, "dtype": a.dtype})
            fed = batchcast.ray.feed(
                ds, stream, batch_size=a.batch, epochs=a.epochs, node_id=host, rows=len(files),
                min_consumers=a.trainers, slots=8, executor_node=nodes[1] if executor_remote else None,
            )
        elif mode == "native":
            fed = batchcast.ray.feed_stream(config, stream, node_id=host, min_consumers=a.trainers, wire=a.wire)
        t0 = time.time()
        pending = [trainer.options(scheduling_strategy=pin).remote(stream, f"t{i}") for i in range(a.trainers)]
        left = list(pending)
        while left:
            _, left = ray.wait(left, num_returns=len(left), timeout=1.0)
            if fed is not None and ray.wait([fed], timeout=0)[0]:
                # A feed that failed says why now, not as its trainers'
                # connect timeout later (a feed done early returns).
                ray.get(fed)
        runs = ray.get(pending)
        figures = ray.get(fed) if fed is not None else {}
        images = len(files) * a.epochs
        host_s = _cpu_s(broker["pid"]) - cpu0["broker"] + figures.get("cpu_s", 0.0)
        raylet_s = _cpu_s(raylet) - cpu0["raylet"]
        # Everything the remote nodes ran (their raylets, Ray's workers and
        # what they started), over the whole run.
        remote_s = sum(_tree_cpu_s(p) for p in remote_raylets) - cpu0["remote"]
        rates = []
        for marks, _ in runs:
            (t_start, _), rest = marks[0], marks[1:]
            rates.append(sum(n for _, n in rest) / (rest[-1][0] - t_start))
        row = {
            "images_s": statistics.median(rates),
            "feed_ms": 1000 * figures["cpu_s"] / figures["samples"] if figures else None,
            "raylet_ms": 1000 * raylet_s / images,
            "wall_s": time.time() - t0,
            "remote_share": None,
            "remote_ms": None,
            "remote_node_ms": None,
        }
        if mode == "ray":
            # Map tasks' decode + augment alone (their process time), from
            # epoch 1 on; the host's share counted with the host.
            (h_n, h_us), (r_n, r_us) = runs[0][1]["host"], runs[0][1]["remote"]
            row["remote_share"] = r_n / max(1, h_n + r_n)
            row["host_pipeline_ms"] = h_us / 1000 / max(1, h_n + r_n)
            row["remote_ms"] = r_us / 1000 / r_n if r_n else None
            host_s += row["host_pipeline_ms"] * images / 1000
            if row["remote_share"]:
                row["remote_node_ms"] = 1000 * remote_s / (row["remote_share"] * images)
        elif mode == "native":
            made = figures["makers"]
            row["remote_share"] = sum(m["samples"] for m in made) / figures["samples"]
            row["remote_ms"] = 1000 * sum(m["cpu_s"] for m in made) / figures["samples"]
            row["remote_node_ms"] = 1000 * remote_s / figures["samples"]
        row["host_ms"] = 1000 * host_s / images
        batchcast.ray.shutdown()
        return row
    finally:
        ray.shutdown()
        cluster.shutdown()


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", type=Path)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--host-cpus", type=int, default=1)
    p.add_argument("--remote-cpus", type=int, default=1)
    p.add_argument("--remote", default="0,1,2", help="remote CPU nodes to try with Ray Data, comma-separated")
    p.add_argument("--native", default="1,2", help="remote CPU nodes to try with feed_stream, comma-separated")
    p.add_argument("--no-handoff", action="store_true", help="leave out table 3 (the hand-off's parts)")
    p.add_argument("--dtype", choices=("f32", "u8"), default="f32",
                   help="the images' dtype: f32 normalised, or u8 (normalised on the GPU)")
    p.add_argument("--wire", choices=("auto", "u8", "as-is"), default="auto",
                   help="feed_stream's wire: an f32 stream's pixels as u8, widened on the host (auto), "
                        "or its own bytes (as-is)")
    p.add_argument("--prepared", type=Path,
                   help="the dataset as `batchcast prepare` copies it (restart markers): rows of the native "
                        "pipeline on it, on the host and with feed_stream, after the others")
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be at least 2 (epoch 0 is not counted)")
    print(f"# {len(list(a.dataset.rglob('*.jpg')))} images, batches of {a.batch}, {a.epochs} epochs, "
          f"{a.dtype} images (feed_stream's wire: {a.wire}), {a.trainers} trainers on the host, host {a.host_cpus} CPU, "
          f"remote nodes {a.remote_cpus} CPU each, "
          f"{os.cpu_count()} cores on this machine")
    rows = [("the broker's own pipeline on the host (no Ray Data)", run(a.dataset, "local", 0, a))]
    for n in (int(x) for x in a.remote.split(",") if x):
        for elsewhere in (False, True) if n > 0 else (False,):
            label = f"Ray Data, host + {n} remote CPU node{'s' if n != 1 else ''}"
            label += ", executor on a remote node" if elsewhere else ""
            rows.append((label, run(a.dataset, "ray", n, a, elsewhere)))
            print(f"  {label}: {rows[-1][1]['images_s']:.0f} images/s")
    for n in (int(x) for x in a.native.split(",") if x):
        label = f"the stream's own pipeline on {n} remote CPU node{'s' if n != 1 else ''} (feed_stream)"
        rows.append((label, run(a.dataset, "native", n, a)))
        print(f"  {label}: {rows[-1][1]['images_s']:.0f} images/s")
    if a.prepared:
        rows.append(("the broker's own pipeline on the host, the prepared copy", run(a.prepared, "local", 0, a)))
        for n in (int(x) for x in a.native.split(",") if x):
            label = f"the stream's own pipeline on {n} remote CPU node{'s' if n != 1 else ''} (feed_stream), the prepared copy"
            rows.append((label, run(a.prepared, "native", n, a)))
            print(f"  {label}: {rows[-1][1]['images_s']:.0f} images/s")
    ray_rows = [r for label, r in rows if label.startswith("Ray Data")]
    base = ray_rows[0]["images_s"] if ray_rows else None
    local = rows[0][1]
    print(
        "\n| pipeline | images/s per trainer | vs Ray Data on the host alone | made remotely "
        "| host's decode+augment CPU-ms per image | feed task CPU-ms per image |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in rows:
        vs = f"{r['images_s'] / base:.2f}x" if base else "-"
        share = "-" if r["remote_share"] is None else f"{100 * r['remote_share']:.0f}%"
        print(f"| {label} | {r['images_s']:.0f} | {vs} | {share} | {_ms(r.get('host_pipeline_ms'))} | {_ms(r['feed_ms'])} |")
    # Table 2: where the CPU goes, host and remote, per image.
    ray_rows_with = [r for r in ray_rows if r["remote_ms"]]

    def vs(key: str, r: dict) -> str:
        theirs = [x[key] for x in ray_rows_with if x.get(key)]
        return f"{statistics.median(theirs) / r[key]:.2f}x" if r.get(key) and theirs else "-"

    print(
        "\n| pipeline | host CPU-ms per image (broker + decode + feed) | vs the host making it | "
        "host raylet CPU-ms per image | remote CPU-ms per image: the pipeline alone | the remote nodes' whole CPU "
        "| remote images per CPU-s: pipeline alone | whole nodes | vs Ray Data's: pipeline alone | whole nodes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows:
        rates = [f"{1000 / r[k]:.0f}" if r[k] else "-" for k in ("remote_ms", "remote_node_ms")]
        print(
            f"| {label} | {r['host_ms']:.2f} | {r['host_ms'] / local['host_ms']:.2f}x | {r['raylet_ms']:.2f} "
            f"| {_ms(r['remote_ms'])} | {_ms(r['remote_node_ms'])} | {rates[0]} | {rates[1]} "
            f"| {vs('remote_ms', r)} | {vs('remote_node_ms', r)} |"
        )
    if not a.no_handoff:
        handoff(a)
    return 0


def handoff(a) -> None:
    """Table 2: Ray Data's iterator and the one copy, per image, on one
    node over a dataset already in its object store."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    print("\n| image field | iterator, rebatched to 32: CPU-ms per image | iterator, blocks as stored | one copy of the bytes |")
    print("|---|---:|---:|---:|")
    try:
        for dtype in (np.float32, np.uint8):
            x = np.random.default_rng(0).integers(0, 255, size=(320, 3, 224, 224)).astype(dtype)
            ds = ray.data.from_numpy(x).materialize()
            cells = []
            for size in (a.batch, None):
                c0, n = time.process_time(), 0
                for _ in range(3):
                    for b in ds.iter_batches(batch_size=size, batch_format="numpy", prefetch_batches=4):
                        n += len(b["data"])
                cells.append(1000 * (time.process_time() - c0) / n)
            dst = np.empty_like(x[: a.batch])
            c0 = time.process_time()
            for i in range(30):
                np.copyto(dst, x[(i % 10) * a.batch : (i % 10 + 1) * a.batch])
            cells.append(1000 * (time.process_time() - c0) / (30 * a.batch))
            name = f"{np.dtype(dtype).name} 3x224x224 ({x[0].nbytes // 1024} KiB)"
            print(f"| {name} | {cells[0]:.3f} | {cells[1]:.3f} | {cells[2]:.3f} |")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
