"""Fan-out against a batch's bytes: 1, 2, 4 and 8 consumer processes of the
Rust client (`batchcast consume`) and of the Python client (numpy views)
on one broker, batches of 64 KiB, 1 MiB, 10 MiB and 100 MiB; prints a table.

Bound: on the zero-copy path no tensor byte moves per consumer. Per batch a
consumer takes a 64-byte mailbox notice, makes a view of the arena (no
copy, no page touched) and writes an 8-byte release; the broker writes 16
bytes per sample (`fill = "stamp"`, 64 samples a batch whatever their
size). So a consumer's batch rate should not depend on the batch's bytes.

Two kinds of consumer:

* `step 0`: each takes batches as fast as it can (all CPU). On a machine
  with fewer cores than consumers they share the cores, so N busy consumers
  cannot each keep one's rate; the columns to compare are the sizes, at a
  given N.
* `step 2 ms`: each spends 2 ms per batch off the CPU (`time.sleep`, the
  consume command's `--sleep-ms`), standing in for a trainer's step on its
  GPU: each should keep at least 90 % of one alone, at every size.

    python bench/fanout_bytes.py [--batches 3000] [--consumers 1,2,4,8]

Needs the release binary (`cargo build --release -p batchcast-cli`) and
a Python with batchcast installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EXE, print  # noqa: E402,A004
from python_client import start_broker  # noqa: E402

SAMPLES = 64

PY_CONSUMER = r"""
import json, sys, time
import batchcast
n, socket, step = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
c = batchcast.Consumer(stream="s", socket=socket, output="numpy", window=4, connect_timeout=60)
got, t0 = 0, None
while got < n:
    for (x,) in c:
        if t0 is None:
            t0 = time.perf_counter()
        got += 1
        if step:
            time.sleep(step)
        if got == n:
            break
print(json.dumps({"batches_per_s": (got - 1) / (time.perf_counter() - t0)}))
"""


def stream(batch_bytes: int, consumers: int) -> str:
    per_sample = batch_bytes // SAMPLES
    return f"""
[[stream]]
name = "s"
batch_size = {SAMPLES}
slots = 8
workers = 1
min_consumers = {consumers}
shuffle = false
[stream.synthetic]
len = {SAMPLES * 100000}
fill = "stamp"
fields = [{{ name = "x", dtype = "u8", shape = [{per_sample}] }}]
"""


def run(client: str, batch_bytes: int, n: int, batches: int, step_ms: int) -> float:
    """The median batches/s of `n` consumers of `client`."""
    with tempfile.TemporaryDirectory() as d:
        broker, sock = start_broker(Path(d), stream(batch_bytes, n))
        try:
            if client == "rust":
                cmd = [EXE, "consume", "--json", "--socket", sock, "--stream", "s", "--window", "4",
                       "--max-batches", str(batches), "--sleep-ms", str(step_ms)]
            else:
                cmd = [sys.executable, "-c", PY_CONSUMER, str(batches), sock, str(step_ms / 1000)]
            kids = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
            rates = []
            for k in kids:
                out, _ = k.communicate(timeout=600)
                if k.returncode != 0:
                    raise SystemExit(f"a {client} consumer failed: {out}")
                rates.append(json.loads(out.strip().splitlines()[-1])["batches_per_s"])
        finally:
            broker.terminate()
            broker.wait()
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3000, help="batches per consumer")
    ap.add_argument("--consumers", default="1,2,4,8")
    ap.add_argument("--sizes-kib", default="64,1024,10240,102400")
    ap.add_argument("--steps-ms", default="0,2")
    a = ap.parse_args()
    counts = [int(x) for x in a.consumers.split(",")]
    sizes = [int(x) * 1024 for x in a.sizes_kib.split(",")]
    steps = [int(x) for x in a.steps_ms.split(",")]
    label = {64 << 10: "64 KiB", 1 << 20: "1 MiB", 10 << 20: "10 MiB", 100 << 20: "100 MiB"}
    name = lambda b: label.get(b, f"{b >> 10} KiB")  # noqa: E731
    print(f"{a.batches} batches per consumer, {SAMPLES} samples a batch, stamp fill, window 4, mailboxes\n")
    print("| client | step | consumers | " + " | ".join(f"{name(b)}: batches/s (vs 1)" for b in sizes) + " |")
    print("|---|---:|---:|" + "---:|" * len(sizes))
    worst_step = {}
    for client in ["rust", "python"]:
        for step in steps:
            alone: dict[int, float] = {}
            for n in counts:
                cells = []
                for b in sizes:
                    r = run(client, b, n, a.batches, step)
                    alone.setdefault(b, r)
                    ratio = r / alone[b]
                    if n > 1:
                        key = (client, step)
                        worst_step[key] = min(worst_step.get(key, 9.9), ratio)
                    cells.append(f"{r:.0f} ({ratio:.2f})")
                print(f"| {client} | {step} ms | {n} | " + " | ".join(cells) + " |")
    print()
    for (client, step), w in sorted(worst_step.items()):
        print(f"{client}, step {step} ms: the lowest share of one consumer's rate at any size: {w:.2f}")


if __name__ == "__main__":
    main()
