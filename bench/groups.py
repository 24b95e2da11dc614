"""Data-parallel trials on one host: a group of DDP ranks fed by one broker
vs one torchvision DataLoader per rank (DistributedSampler, 2 workers each).

Every rank is a real process that joins a gloo process group and
all-reduces a scalar after each batch (DDP's step, without a model), so the
ranks move in step as DDP's do. Both sides run the same augmentation:
RandomResizedCrop(224) + horizontal flip + Normalize to float32 NCHW, on
an ImageFolder of photographs (`bench/prepare_photos.py`).

Tables:
1. One trial of 4 ranks: one group on one broker vs 4 DataLoaders.
2. Two trials of 2 ranks each (a sweep): two groups on one broker vs 4
   DataLoaders (2 per trial, each trial reading the whole dataset).
3. Broker memory as a group grows from 1 to 8 ranks.

images/s: images handed to the ranks per second, from the first batch any
rank gets to the last (every rank's start-up excluded). CPU-ms per image:
every process of the run (ranks, DataLoader workers, the broker), start-up
included, over the images handed out. Memory: the peak of the summed
proportional set size (PSS: shared pages split among their processes) of
the ranks with their workers, and of the broker, sampled every 100 ms.

    python bench/groups.py DATASET [--epochs 3] [--batch 32] [--tables 1,2,3]

Needs the release broker (`cargo build --release -p batchcast-cli`), and
a Python with batchcast, torch and torchvision (bench/groups.sh sets it up).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXE, image_stream, print  # noqa: E402,A004

# One rank: `batchcast` (a group member) or `loader` (its own DataLoader).
RANK = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
kind, root, epochs, batch, rank, world, init = sys.argv[1:8]
epochs, batch, rank, world = int(epochs), int(batch), int(rank), int(world)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
images, first, last = 0, None, None

def step(n):
    global images, first, last
    now = time.time()
    first = first or now
    images += n
    t = torch.ones(1)
    dist.all_reduce(t)  # DDP's gradient all-reduce, without a model
    last = time.time()

if kind == "batchcast":
    import batchcast
    c = batchcast.Consumer("train", socket=os.environ["SOCKET"], group=os.environ["GROUP"],
                           rank=rank, world=world, output="torch")
    while not c.ended:
        for b in c:
            x = b["image"]
            step(x.shape[0])
else:
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                    T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(root, transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2, persistent_workers=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, _ in loader:
            step(x.shape[0])
    del loader
dist.destroy_process_group()
print(json.dumps({"images": images, "first": first, "last": last}))
"""


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


class Sampler(threading.Thread):
    """Peak summed PSS of the rank trees and of the broker."""

    def __init__(self, ranks: list[int], broker: int | None) -> None:
        super().__init__(daemon=True)
        self.ranks, self.broker = ranks, broker
        self.ranks_peak = self.broker_peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            total = sum(pss_kb(p) for r in self.ranks for p in descendants(r))
            self.ranks_peak = max(self.ranks_peak, total)
            if self.broker:
                self.broker_peak = max(self.broker_peak, pss_kb(self.broker))
            time.sleep(0.1)


def slots(ranks: int) -> int:
    """The ring a group of `ranks` needs (the broker refuses less): each
    member holds a batch (window 2) while the next comes, its batches
    `ranks` apart, so about 2 x ranks + 2 batches are in flight, as each
    DataLoader's prefetch keeps 2 batches per worker."""
    return max(8, 2 * ranks + 2)


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(kind: str, a, trials: int, ranks: int, tmp: Path, ring: int | None = None) -> dict:
    """`trials` trials of `ranks` ranks each, fed by one broker or by their
    own DataLoaders; returns the table's numbers."""
    cpu0 = cpu_children()
    broker = None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kind == "batchcast":
        cfg = tmp / "broker.toml"
        cfg.write_text(image_stream("train", a.dataset, a.batch, epochs=a.epochs, slots=ring or slots(ranks),
                                    workers=a.workers, min_consumers=trials * ranks, seed=1, drop_last=False))
        sock = str(tmp / "b.sock")
        broker = subprocess.Popen([EXE, "serve", "--socket", sock, "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=open(tmp / "broker.log", "w"))
        env["SOCKET"] = sock
    procs = []
    for t in range(trials):
        init = f"file://{tmp}/rdzv-{kind}-{t}-{time.monotonic_ns()}"
        for r in range(ranks):
            env_t = dict(env, GROUP=f"trial-{t}")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", RANK, kind, a.dataset, str(a.epochs), str(a.batch), str(r), str(ranks), init],
                env=env_t, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    sampler = Sampler([p.pid for p in procs], broker.pid if broker else None)
    sampler.start()
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a {kind} rank failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    sampler.done.set()
    sampler.join()
    if broker:
        broker.terminate()
        broker.wait()
    images = sum(r["images"] for r in reports)
    span = max(r["last"] for r in reports) - min(r["first"] for r in reports)
    return {
        "images": images,
        "images_s": images / span,
        "cpu_ms": 1000 * (cpu_children() - cpu0) / images,
        "ranks_mib": sampler.ranks_peak / 1024,
        "broker_mib": sampler.broker_peak / 1024,
    }


def row(label: str, r: dict, base: dict | None) -> str:
    vs = f"{r['images_s'] / base['images_s']:.2f}x" if base else "1.00x"
    cpu = f"{base['cpu_ms'] / r['cpu_ms']:.2f}x" if base else "1.00x"
    broker = f"{r['broker_mib']:.0f}" if r["broker_mib"] else "-"
    return (f"| {label} | {r['images']} | {r['images_s']:.0f} | {vs} | {r['cpu_ms']:.2f} | {cpu} "
            f"| {r['ranks_mib']:.0f} | {broker} |")


HEADER = ("| feeding | images | images/s | vs DataLoaders | CPU-ms per image | CPU vs DataLoaders "
          "| ranks + workers PSS MiB | broker PSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="the broker's pipeline threads")
    ap.add_argument("--tables", default="1,2,3", help="which tables, e.g. 3")
    a = ap.parse_args()
    a.tables = {int(t) for t in a.tables.split(",")}
    a.dataset = str(Path(a.dataset).resolve())
    n = sum(len(files) for _, _, files in os.walk(a.dataset))
    print(f"dataset: {a.dataset} ({n} images), {a.epochs} epochs, batches of {a.batch}, "
          f"RandomResizedCrop(224) + flip + Normalize, f32 NCHW; broker: {a.workers} pipeline threads; "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for table, title, trials, ranks in [(1, "One trial of 4 DDP ranks", 1, 4), (2, "Two trials of 2 DDP ranks", 2, 2)]:
            if table not in a.tables:
                continue
            print(f"\n{title}\n\n{HEADER}")
            base = run("loader", a, trials, ranks, tmp)
            print(row(f"{trials * ranks} DataLoaders (DistributedSampler, 2 workers each)", base, None))
            ours = run("batchcast", a, trials, ranks, tmp)
            label = "one group on one broker" if trials == 1 else f"{trials} groups on one broker"
            print(row(label, ours, base))
        if 3 not in a.tables:
            return
        # One ring for every size (the widest group's), so what grows with
        # the ranks shows apart from the ring.
        ring = slots(8)
        mib = 224 * 224 * 3 * 4 * a.batch / 2**20
        print(f"\nBroker memory as one group grows (slots = {ring}: a {ring * mib:.0f} MiB ring)\n\n"
              "| ranks | broker PSS MiB | ranks PSS MiB | images/s |\n|---:|---:|---:|---:|")
        for ranks in [1, 2, 4, 8]:
            r = run("batchcast", a, 1, ranks, tmp, ring)
            print(f"| {ranks} | {r['broker_mib']:.0f} | {r['ranks_mib']:.0f} | {r['images_s']:.0f} |")


if __name__ == "__main__":
    main()
