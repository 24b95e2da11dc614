"""Benchmarks of the Python client; prints two tables.

1. Per-batch overhead of a consumer (receive + DLPack + release): the Rust
   client (`batchcast consume`) vs the Python client with numpy and torch
   output, on an endless synthetic stream that costs the broker almost
   nothing to fill (`fill = "stamp"`). The bound: per batch only a 64-byte
   notice and an 8-byte release pass through the consumer's shared-memory
   mailbox (no system call unless a side sleeps), so the Python cost is interpreter
   and DLPack work, independent of the batch's size.
2. Sharing a PyTorch DataLoader with 1, 2 and 4 consumer processes:
   `batchcast.Producer` vs the `tensorsocket` package, same loader, same
   batch shape. Throughput is measured at the consumers (batches delivered
   to all of them per second, first batch to last).

    python bench/python_client.py [--batches 20000] [--repeats 3]

Needs the release binary (`cargo build --release -p batchcast-cli`) and
a Python with batchcast installed; table 2 needs torch (and tensorsocket
for its rows).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXE, print  # noqa: E402,A004

STREAM = """
[[stream]]
name = "s"
batch_size = 32
slots = 8
workers = 1
[stream.synthetic]
len = 320
fill = "stamp"
fields = [{ name = "image", dtype = "u8", shape = [3, 64, 64] }, { name = "label", dtype = "i64", shape = [] }]
"""

PY_CONSUMER = r"""
import json, sys, time
import batchcast
n, output, socket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
c = batchcast.Consumer(stream="s", socket=socket, output=output)
got = 0
t0 = None
while got < n:
    for images, labels in c:
        if t0 is None:
            t0, c0 = time.perf_counter(), time.process_time()
        got += 1
        if got == n:
            break
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0, "batches": got}))
"""


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_broker(tmp: Path, config: str | None) -> tuple[subprocess.Popen, str]:
    sock = str(tmp / "b.sock")
    args = [EXE, "serve", "--socket", sock]
    if config:
        (tmp / "b.toml").write_text(config)
        args += ["--config", str(tmp / "b.toml")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(tmp / "broker.log", "w"))
    for _ in range(500):
        if subprocess.run([EXE, "stats", "--socket", sock], capture_output=True).returncode == 0:
            return proc, sock
        time.sleep(0.02)
    raise SystemExit("the broker did not start")


def consumer_overhead(batches: int, repeats: int) -> None:
    have_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0
    clients = ["rust", "python/numpy"] + (["python/torch"] if have_torch else [])
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in clients}
    with tempfile.TemporaryDirectory() as d:
        broker, sock = start_broker(Path(d), STREAM)
        try:
            for _ in range(repeats):
                for client in clients:
                    cpu0 = child_cpu()
                    if client == "rust":
                        out = subprocess.run(
                            [EXE, "consume", "--json", "--socket", sock, "--stream", "s", "--max-batches", str(batches)],
                            capture_output=True, text=True, check=True,
                        ).stdout
                        r = json.loads(out.strip().splitlines()[-1])
                        seconds = r["seconds"]
                        cpu = child_cpu() - cpu0  # the whole process, start-up included
                    else:
                        out = subprocess.run(
                            [sys.executable, "-c", PY_CONSUMER, str(batches), client.split("/")[1], sock],
                            capture_output=True, text=True, check=True,
                        ).stdout
                        r = json.loads(out)
                        seconds, cpu = r["seconds"], r["cpu"]  # the batch loop only
                    results[client].append((seconds / batches * 1e6, cpu / batches * 1e6))
        finally:
            broker.terminate()
            broker.wait()
    print(f"\nConsumer per-batch cost, {batches} batches of 32 x (3x64x64 u8 + i64), median of {repeats}")
    print(f"{'client':<14} {'wall µs/batch':>14} {'CPU µs/batch':>13} {'vs Rust (CPU)':>14}")
    base = statistics.median(c for _, c in results["rust"])
    for client in clients:
        wall = statistics.median(w for w, _ in results[client])
        cpu = statistics.median(c for _, c in results[client])
        print(f"{client:<14} {wall:>14.1f} {cpu:>13.1f} {cpu / base:>13.2f}x")
    print("(Rust CPU is the whole process, start-up included; Python CPU is the batch loop only)")


SHARE_CONSUMER = r"""
import json, sys, time
kind, socket, epochs, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
first = last = None
n = 0
checksum = 0


def take(epoch):
    global first, last, n, checksum
    for images, labels in epoch:
        now = time.monotonic()
        first = first or now
        last = now
        checksum += int(labels[0])
        n += 1


if kind == "batchcast":
    import batchcast
    c = batchcast.Consumer(stream="dl", socket=socket, connect_timeout=60)
    while not c.ended:
        take(c)
else:
    from tensorsocket.consumer import TensorConsumer
    c = TensorConsumer(port=port, ack_port=port + 1, heart_ports=(port + 2, port + 3), batch_size=int(sys.argv[5]))
    for e in range(epochs):
        take(c)
print(json.dumps({"first": first, "last": last, "batches": n, "checksum": checksum}))
"""

TS_PRODUCER = r"""
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from tensorsocket.producer import TensorProducer
port, epochs, n, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
images = torch.randint(0, 255, (n, 3, 64, 64), dtype=torch.uint8)
labels = torch.arange(n)
loader = DataLoader(TensorDataset(images, labels), batch_size=batch, shuffle=False)
p = TensorProducer(loader, port=port, ack_port=port + 1, heart_ports=(port + 2, port + 3), producer_batch_size=1)
for _ in range(epochs):
    for _ in p:
        pass
p.join()
"""


def share_dataloader(epochs: int, samples: int, batch: int, args_ts_timeout: int, with_ts: bool) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import batchcast

    try:
        import tensorsocket  # noqa: F401

        have_ts = with_ts
    except ImportError:
        have_ts = False
    per_epoch = samples // batch
    rows = []
    for consumers in (1, 2, 4):
        # batchcast
        with tempfile.TemporaryDirectory() as d:
            broker, sock = start_broker(Path(d), None)
            kids = [
                subprocess.Popen([sys.executable, "-c", SHARE_CONSUMER, "batchcast", sock, str(epochs), "0"],
                                 stdout=subprocess.PIPE, text=True)
                for _ in range(consumers)
            ]
            images = torch.randint(0, 255, (samples, 3, 64, 64), dtype=torch.uint8)
            loader = DataLoader(TensorDataset(images, torch.arange(samples)), batch_size=batch, shuffle=False)
            batchcast.Producer(loader, stream="dl", socket=sock, epochs=epochs, min_consumers=consumers).run()
            reports = [json.loads(k.communicate(timeout=300)[0]) for k in kids]
            broker.terminate()
            broker.wait()
        rows.append(("batchcast", consumers, reports))
        if have_ts:
            port = 26000 + consumers * 10
            prod = subprocess.Popen([sys.executable, "-c", TS_PRODUCER, str(port), str(epochs), str(samples), str(batch)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(2)
            kids = [
                subprocess.Popen([sys.executable, "-c", SHARE_CONSUMER, "tensorsocket", "", str(epochs), str(port), str(batch)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(consumers)
            ]
            try:
                reports = [json.loads(k.communicate(timeout=args_ts_timeout)[0]) for k in kids]
                rows.append(("tensorsocket", consumers, reports))
            except subprocess.TimeoutExpired:
                rows.append(("tensorsocket", consumers, f"did not finish within {args_ts_timeout} s"))
                for k in kids:
                    k.kill()
            except Exception as e:  # report, keep the batchcast rows
                rows.append(("tensorsocket", consumers, f"failed: {e}"))
                for k in kids:
                    k.kill()
            prod.kill()
            prod.wait()
    mb = batch * 3 * 64 * 64 / 1e6
    print(f"\nSharing a DataLoader ({samples} samples of 3x64x64 u8, batches of {batch} = {mb:.2f} MB, {epochs} epochs = {epochs * per_epoch} batches)")
    print(f"{'loader':<13} {'consumers':>9} {'batches/s each':>15} {'GB/s delivered':>15} {'complete':>9}")
    for kind, consumers, reports in rows:
        if isinstance(reports, str):
            print(f"{kind:<13} {consumers:>9} {reports}")
            continue
        span = max(r["last"] for r in reports) - min(r["first"] for r in reports)
        each = statistics.median(r["batches"] for r in reports) / span
        total = sum(r["batches"] for r in reports) * mb / 1e3 / span
        complete = all(r["batches"] == epochs * per_epoch for r in reports)
        print(f"{kind:<13} {consumers:>9} {each:>15.0f} {total:>15.2f} {str(complete):>9}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-tensorsocket", action="store_true")
    p.add_argument("--tensorsocket-timeout", type=int, default=120)
    args = p.parse_args()
    if not Path(EXE).exists():
        raise SystemExit(f"no broker binary at {EXE}: cargo build --release -p batchcast-cli")
    consumer_overhead(args.batches, args.repeats)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("\n(torch is not installed: skipping the DataLoader sharing table)")
        return
    share_dataloader(args.epochs, args.samples, args.batch, args.tensorsocket_timeout, not args.no_tensorsocket)


if __name__ == "__main__":
    main()
