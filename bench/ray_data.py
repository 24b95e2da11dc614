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
the host.

Table 2 splits the hand-off: Ray Data's iterator over a dataset already
in the object store, rebatched or as stored, and a plain copy of the same
bytes (the bound of the Producer's one copy into the ring, and of what a
native reader of Ray's object store would still have to copy).

On one machine the "remote" nodes share its cores: with 2 cores, host
(1 CPU) + 1 remote node uses both, a second remote node adds Ray tasks but
no core. The table shows the hand-off and the scheduling, not a cluster's
scaling; on real nodes each remote node brings its own cores.

    python bench/ray_data.py DATASET [--epochs 4] [--remote 0,1,2]

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

def augment(batch, nodes):
    """Decode and augment a batch of JPEG files, as torchvision's
    RandomResizedCrop(224) + RandomHorizontalFlip + Normalize would."""
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
        a = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0
        images.append((a - MEAN) / STD)
    n = len(images)
    cpu_us = int((time.process_time() - t0) * 1e6 / n)
    return {"image": np.stack(images), "node": np.full(n, here, dtype=np.int64), "cpu_us": np.full(n, cpu_us)}


@ray.remote(num_cpus=0)
def trainer(stream: str, name: str):
    c = batchcast.Consumer(stream=stream, output="numpy", name=name, connect_timeout=120)
    marks, remote, host_cpu_us = [], 0, 0
    while not c.ended:
        n = 0
        for b in c:
            images = b["image"]
            if stream != "native" and c.epoch > 0:
                on_host = b["node"] == 0
                remote += int((~on_host).sum())
                host_cpu_us += int(b["cpu_us"][on_host].sum())
            n += images.shape[0]
            time.sleep(0.002)  # the trainer's step
        marks.append((time.time(), n))
    return marks, remote, host_cpu_us


def run(root: Path, remote_nodes: int, a, executor_remote: bool = False) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": a.host_cpus, "include_dashboard": False})
    for _ in range(remote_nodes):
        cluster.add_node(num_cpus=a.remote_cpus)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        host = ray.get_runtime_context().get_node_id()
        nodes = [host] + [n["NodeID"] for n in ray.nodes() if n["NodeID"] != host and n["Alive"]]
        pin = NodeAffinitySchedulingStrategy(node_id=host, soft=False)
        files = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        if remote_nodes < 0:  # the reference: the broker's own pipeline
            batchcast.ray.init(
                image_stream(
                    "native", root, a.batch, epochs=a.epochs, workers=a.host_cpus, min_consumers=a.trainers, seed=1
                )
            )
            stream = "native"
        else:
            batchcast.ray.init()
            stream = "ray"
            ds = ray.data.read_binary_files(files, override_num_blocks=max(4, 4 * len(nodes)))
            ds = ds.map_batches(augment, batch_size=a.batch, fn_kwargs={"nodes": nodes})
            fed = batchcast.ray.feed(
                ds, stream, batch_size=a.batch, epochs=a.epochs, node_id=host, rows=len(files),
                min_consumers=a.trainers, slots=8, executor_node=nodes[1] if executor_remote else None,
            )
        t0 = time.time()
        runs = ray.get([trainer.options(scheduling_strategy=pin).remote(stream, f"t{i}") for i in range(a.trainers)])
        handoff_ms = None
        if remote_nodes >= 0:
            figures = ray.get(fed)
            handoff_ms = 1000 * figures["cpu_s"] / figures["samples"]
        rates = []
        for marks, _, _ in runs:
            (t_start, _), rest = marks[0], marks[1:]
            rates.append(sum(n for _, n in rest) / (rest[-1][0] - t_start))
        counted = max(1, len(files) * (a.epochs - 1))
        batchcast.ray.shutdown()
        return {
            "images_s": statistics.median(rates),
            "remote_share": runs[0][1] / counted,
            "host_pipeline_ms": runs[0][2] / 1000 / counted,
            "handoff_ms": handoff_ms,
            "wall_s": time.time() - t0,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", type=Path)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--host-cpus", type=int, default=1)
    p.add_argument("--remote-cpus", type=int, default=1)
    p.add_argument("--remote", default="0,1,2", help="remote CPU nodes to try, comma-separated")
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be at least 2 (epoch 0 is not counted)")
    print(f"# {len(list(a.dataset.rglob('*.jpg')))} images, batches of {a.batch}, {a.epochs} epochs, "
          f"{a.trainers} trainers on the host, host {a.host_cpus} CPU, remote nodes {a.remote_cpus} CPU each, "
          f"{os.cpu_count()} cores on this machine")
    rows = [("the broker's own pipeline (no Ray Data)", run(a.dataset, -1, a))]
    for n in (int(x) for x in a.remote.split(",")):
        for elsewhere in (False, True) if n > 0 else (False,):
            label = f"Ray Data, host + {n} remote CPU node{'s' if n != 1 else ''}"
            label += ", executor on a remote node" if elsewhere else ""
            rows.append((label, run(a.dataset, n, a, elsewhere)))
            print(f"  {label}: {rows[-1][1]['images_s']:.0f} images/s")
    base = rows[1][1]["images_s"]
    print(
        "\n| pipeline | images/s per trainer | vs Ray Data on the host alone | made remotely "
        "| host's decode+augment CPU-ms per image | feed task CPU-ms per image |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in rows:
        if label.startswith("the broker"):
            print(f"| {label} | {r['images_s']:.0f} | {r['images_s'] / base:.2f}x | - | - | - |")
            continue
        print(
            f"| {label} | {r['images_s']:.0f} | {r['images_s'] / base:.2f}x | {100 * r['remote_share']:.0f}% "
            f"| {r['host_pipeline_ms']:.2f} | {r['handoff_ms']:.2f} |"
        )
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
