"""The GPU path on a real GPU, in one run (started by bench/gpu.sh).

Needs torch with CUDA and the batchcast wheel; the broker binary is
--broker. Prints one markdown table:

* H2D bandwidth: torch's pinned ``.to("cuda", non_blocking=True)`` of one
  slot's bytes vs the broker's copy path (bytes / GPU time of its copies,
  from `batchcast stats`). Target: broker ≥ 90 % of torch.
* Batches/s per consumer with 1, 2 and 4 processes on cuda:0, each taking
  every field of every batch as a device tensor (no compute), and the
  broker's H2D copies per batch published (target: 1.00 whatever the
  number of consumers: zero copies per consumer). Target: per-consumer rate
  with 4 ≥ 90 % of the rate with 1.
* Hand-off latency, median: from the broker sending a batch (a device
  batch is sent once its H2D copy is done) to the trainer holding it, for a
  GPU consumer and a host consumer of the same stream.
* Batches/s per consumer with 1, 2 and 4 host consumers of the same
  stream: what of the scaling is not GPU-specific.
* With two or more GPUs: how a batch best reaches a second GPU, measured
  with torch on the same bytes: a second host-to-device copy (what the
  broker does: one copy per GPU from page-locked host memory), or a
  device-to-device copy from the first GPU (peer access over NVLink or
  PCIe), each alone and with the first GPU's own copy running at once.
* One consumer model (issue 51): GPU consumers of batches of B/2, B and
  2B together, each against its rate alone (target ≥ 90 %), with H2D
  copies per unit (target 1.00); a GPU consumer joining now mid-epoch:
  the time to its first, replayed batch (target ≤ 1 s). Where the GPU's
  arena is not mirrored (CUDA IPC memory) another batch size is refused:
  the row says so.
* Content: a position-weighted checksum of every field of every batch of an
  epoch computed on the GPU by a GPU consumer equals the same checksum
  computed by a host consumer of the same stream. The stream has fewer
  device slots (3) than host slots (8), so the two rings wrap
  independently while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import batchcast

SLOT_FIELDS = (
    '{ name = "image", dtype = "u8", shape = [3, 224, 224] }, '
    '{ name = "label", dtype = "i64", shape = [] }'
)


def config(
    batch: int, length: int, epochs: int, fill: str, slots: int, min_consumers: int, gpu_slots: int | None = None
) -> str:
    return f"""
[[stream]]
name = "gpu"
batch_size = {batch}
epochs = {epochs}
slots = {slots}
gpu_slots = {gpu_slots or slots}
min_consumers = {min_consumers}
drop_last = false
workers = 2
[stream.synthetic]
len = {length}
fill = "{fill}"
fields = [{SLOT_FIELDS}]
"""


class Broker:
    def __init__(self, exe: str, cfg: str, tmp: Path) -> None:
        self.exe = exe
        self.dir = Path(tempfile.mkdtemp(dir=tmp))
        (self.dir / "b.toml").write_text(cfg)
        self.socket = str(self.dir / "b.sock")
        self.log = open(self.dir / "broker.log", "w")
        self.proc = subprocess.Popen(
            [exe, "serve", "--config", str(self.dir / "b.toml"), "--socket", self.socket],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"broker did not start: {(self.dir / 'broker.log').read_text()}")
            time.sleep(0.05)

    def stats(self) -> dict:
        out = subprocess.run(
            [self.exe, "stats", "--json", "--socket", self.socket], capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)["streams"][0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


CONSUMER = r"""
import json, sys, time, torch, batchcast
socket, limit, device, window = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
size = int(sys.argv[5]) if len(sys.argv) > 5 else None
c = batchcast.Consumer(stream="gpu", socket=socket, device=device, window=window, connect_timeout=30, batch_size=size)
n, handoff, t0 = 0, [], None
for epoch in range(1000):
    for images, labels in c:
        if t0 is None:
            t0 = time.perf_counter()
        assert images.is_cuda == (device != "cpu")
        n += 1
        if n >= limit:
            break
    if n >= limit or c.ended:
        break
# Only a GPU consumer has GPU work to wait for: on a host consumer this
# call would start a CUDA context (a few hundred ms) inside the timing.
if device != "cpu":
    torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(json.dumps({"batches": n - 1, "seconds": dt}))
"""


def scaling(
    exe: str, device: str, counts: tuple[int, ...], batch: int, batches: int, slots: int, window: int, tmp: Path,
    dump: str | None = None,
) -> tuple[dict, dict]:
    """Median batches/s per consumer, and the broker's stats, for each
    number of consumers in ``counts`` on ``device``, each taking every field
    of every batch and nothing else."""
    rates, stats = {}, {}
    for n in counts:
        # Long enough that no consumer reaches the end: the rate is steady state.
        b = Broker(exe, config(batch, batch * (batches + 64), 1, "stamp", slots, n), tmp)
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", CONSUMER, b.socket, str(batches), device, str(window)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(n)
            ]
            reports = []
            for pr in procs:
                out, err = pr.communicate(timeout=300)
                if pr.returncode != 0:
                    raise SystemExit(f"{device} consumer failed:\n{err}")
                reports.append(json.loads(out.strip().splitlines()[-1]))
            stats[n] = b.stats()
        finally:
            b.stop()
        rates[n] = statistics.median(r["batches"] / r["seconds"] for r in reports)
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"stats-{device.replace(':', '')}-{n}.json").write_text(json.dumps(stats[n], indent=1))
    return rates, stats


def torch_h2d(nbytes: int, reps: int = 50) -> float:
    """GB/s of a pinned host tensor to cuda:0, non_blocking, timed on the GPU."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def gpu_seconds(fn, reps: int = 30) -> float:
    """Median wall seconds of ``fn()`` (GPU work, synchronised)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def second_gpu_rows(nbytes: int) -> list[tuple[str, str, str]]:
    """Host copy vs peer copy to cuda:1 (see the module docstring)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    d1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    d0.copy_(host)
    peer = torch.cuda.can_device_access_peer(1, 0)
    gb = nbytes / 1e9
    h2d = gpu_seconds(lambda: d1.copy_(host, non_blocking=True))
    p2p = gpu_seconds(lambda: d1.copy_(d0, non_blocking=True))

    def both_from_host():
        d0.copy_(host, non_blocking=True)
        with torch.cuda.device(1):
            d1.copy_(host, non_blocking=True)

    def first_then_peer():
        d0.copy_(host, non_blocking=True)
        d1.copy_(d0, non_blocking=True)

    both = gpu_seconds(both_from_host)
    chain = gpu_seconds(first_then_peer)
    return [
        ("cuda:1 from host (H2D)", f"{gb / h2d:.1f} GB/s", ""),
        ("cuda:1 from cuda:0 (peer)", f"{gb / p2p:.1f} GB/s", f"peer access {'on' if peer else 'OFF (staged through the host)'}"),
        (
            "a batch onto both GPUs, each from host",
            f"{1e6 * both:.0f} µs",
            "what the broker does",
        ),
        (
            "a batch onto both GPUs, host → cuda:0 → cuda:1",
            f"{1e6 * chain:.0f} µs",
            f"{'peer is faster' if chain < both else 'host copies are faster'} on this machine",
        ),
    ]


def consumers(b: Broker, specs: list[tuple[int, int | None]], window: int) -> list[dict]:
    """GPU consumers of `b`'s stream on cuda:0, one per (batches, batch
    size) in `specs`, run together; their reports."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONSUMER, b.socket, str(n), "cuda:0", str(window), *([str(size)] if size else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, size in specs
    ]
    reports = []
    for pr in procs:
        out, err = pr.communicate(timeout=300)
        if pr.returncode != 0:
            reports.append({"error": err.strip().splitlines()[-1] if err.strip() else f"exit {pr.returncode}"})
        else:
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def one_model_rows(exe: str, batch: int, batches: int, slots: int, tmp: Path) -> list[tuple[str, str, str]]:
    """Issue 51's measures: GPU consumers of their own batch sizes (each
    with the others vs alone, copies per unit), and a GPU consumer joining
    now: how soon its first (replayed) batch arrives."""
    rows = []
    sizes = (batch // 2, batch, 2 * batch)
    # Units to cover each consumer's run; slots for the largest size.
    units = batches * 2 + 64
    big = max(slots, 16)  # window 4 of batches of 2B span 15 units
    alone = {}
    for size in sizes:
        b = Broker(exe, config(batch, batch * units, 1, "stamp", big, 1), tmp)
        try:
            (r,) = consumers(b, [(batches * batch // size, size)], 4)
        finally:
            b.stop()
        alone[size] = r
    b = Broker(exe, config(batch, batch * units, 1, "stamp", big, len(sizes)), tmp)
    try:
        together = consumers(b, [(batches * batch // s, s) for s in sizes], 4)
        st = b.stats()
    finally:
        b.stop()
    for size, r in zip(sizes, together):
        a = alone[size]
        if "error" in r or "error" in a:
            rows.append((f"GPU consumer of batches of {size}, with the others", "refused", r.get("error") or a["error"]))
            continue
        rate, rate_alone = r["batches"] / r["seconds"], a["batches"] / a["seconds"]
        rows.append(
            (
                f"GPU consumer of batches of {size}, with {len(sizes) - 1} others, batches/s",
                f"{rate:.0f}",
                f"{100 * rate / rate_alone:.0f} % of its rate alone (target ≥ 90 %)",
            )
        )
    g = st["gpus"][0] if st["gpus"] else None
    if g:
        rows.append(("H2D copies per unit, mixed batch sizes", f"{g['copies'] / max(st['batches_produced'], 1):.2f}", "target 1.00"))
    # Join now: a steady GPU reader, then one joining mid-epoch.
    b = Broker(exe, config(batch, batch * units, 1, "stamp", slots, 1), tmp)
    try:
        steady = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, b.socket, str(batches), "cuda:0", "4"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(2.0)
        t0 = time.perf_counter()
        late = batchcast.Consumer(stream="gpu", socket=b.socket, device="cuda:0", join="now", name="late")
        first = next(iter(late))
        waited = time.perf_counter() - t0
        replayed = first.replayed
        del first, late
        steady.kill()
        steady.wait()
        gr = b.stats()["gpus"][0]["replayed"]
    finally:
        b.stop()
    rows.append(
        (
            "GPU consumer joining now mid-epoch: first batch after",
            f"{waited:.3f} s",
            f"replayed {replayed}; {gr} replayed copies (target ≤ 1 s)",
        )
    )
    return rows


def checksum(t: torch.Tensor) -> int:
    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat * weights).sum().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=3000, help="batches per consumer run (fewer measure start-up, not the rate)")
    p.add_argument("--tmp", default=tempfile.gettempdir())
    p.add_argument("--slots", type=int, default=8, help="host and device slots of the scaling runs")
    p.add_argument("--window", type=int, default=4, help="each scaling consumer's window")
    p.add_argument("--dump", help="folder to write each run's `batchcast stats --json` into")
    a = p.parse_args()
    tmp = Path(a.tmp)
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    gpu = torch.cuda.get_device_name(0)
    slot_bytes = a.batch * (3 * 224 * 224 + 8)
    rows = []

    # 1. Rate per consumer with 1, 2, 4 GPU consumers; H2D bandwidth of the
    # broker's copies; copies per batch. The same with host consumers of the
    # same stream shows what is GPU-specific.
    counts = (1, 2, 4)
    rates, stats = scaling(a.broker, "cuda:0", counts, a.batch, a.batches, a.slots, a.window, tmp, a.dump)
    # A host consumer takes a batch in microseconds: ten times the batches
    # so that the run is not over before every consumer is under way.
    host_rates, _ = scaling(a.broker, "cpu", counts, a.batch, 10 * a.batches, a.slots, a.window, tmp)
    copies_per_batch = {n: s["gpus"][0]["copies"] / max(s["batches_produced"], 1) for n, s in stats.items()}
    g = stats[1]["gpus"][0]
    broker_gbs = g["bytes"] / g["copy_s"] / 1e9 if g["copy_s"] > 0 else float("nan")
    pinned = g["pinned"]

    torch_gbs = torch_h2d(slot_bytes)
    rows.append(("H2D, torch pinned .to(cuda, non_blocking)", f"{torch_gbs:.1f} GB/s", ""))
    rows.append(
        (
            f"H2D, broker copy path ({'page-locked' if pinned else 'pageable'})",
            f"{broker_gbs:.1f} GB/s",
            f"{100 * broker_gbs / torch_gbs:.0f} % of torch (target ≥ 90 %)",
        )
    )
    for n in (1, 2, 4):
        rows.append(
            (
                f"{n} GPU consumer(s), batches/s each",
                f"{rates[n]:.0f}",
                f"{100 * rates[n] / rates[1]:.0f} % of 1; H2D copies per batch {copies_per_batch[n]:.2f}",
            )
        )
    for n in (1, 2, 4):
        rows.append(
            (
                f"{n} host consumer(s) of the same stream, batches/s each",
                f"{host_rates[n]:.0f}",
                f"{100 * host_rates[n] / host_rates[1]:.0f} % of 1",
            )
        )

    # 2. Hand-off latency and content, with real bytes.
    b = Broker(a.broker, config(a.batch, 40 * a.batch, 1, "full", 8, 2, gpu_slots=3), tmp)
    try:
        host = batchcast.Consumer(stream="gpu", socket=b.socket, device="cpu", window=4, name="host")
        dev = batchcast.Consumer(stream="gpu", socket=b.socket, device="cuda:0", window=2, name="gpu")
        lat_gpu, lat_host, equal, total = [], [], 0, 0
        for bh, bd in zip(host, dev):
            lat_host.append(bh._raw.handoff_s)
            lat_gpu.append(bd._raw.handoff_s)
            for i in range(len(bd.keys())):
                total += 1
                assert bd[i].is_cuda and not bh[i].is_cuda
                equal += checksum(bd[i]) == checksum(bh[i])
    finally:
        b.stop()
    rows.append(
        (
            "hand-off latency p50, GPU consumer (sent once copied)",
            f"{1e6 * statistics.median(lat_gpu):.0f} µs",
            f"host consumer {1e6 * statistics.median(lat_host):.0f} µs",
        )
    )
    rows.append(("content: GPU checksum == host checksum", f"{equal}/{total} fields", ""))
    rows += one_model_rows(a.broker, a.batch, a.batches, a.slots, tmp)
    if torch.cuda.device_count() >= 2:
        rows += second_gpu_rows(slot_bytes)
    else:
        rows.append(("host vs peer copy to a second GPU", "not measured", "one GPU visible"))

    print(f"\nbatchcast GPU path on {gpu}: {a.batch} × 3×224×224 u8 + i64 label = {slot_bytes / 1e6:.1f} MB per batch\n")
    print("| measure | value | note |")
    print("| --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if equal != total:
        raise SystemExit("content check FAILED")


if __name__ == "__main__":
    main()
