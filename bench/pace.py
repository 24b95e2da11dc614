"""What a sweep pays under each pace policy: three trainers on one broker
reading a folder of real photographs (bench/prepare_photos.py, 1,200
JPEGs) through torchvision's RandomResizedCrop(224) + flip + Normalize,
batches of 32, each trainer `--batches` batches, in three scenarios:

  steps    per-batch steps of 2, 8 and 32 ms
  pauses   the same, each pausing 5 s every 50 batches, at different times
  stopped  the same steps, the 8 ms one SIGSTOPped after 20 batches for
           `--stop-s` seconds, then continued

and four policies: the defaults (no pace or hold key), `pace =
"lockstep"` (its hold limit, 2 s), `"lockstep"` with `hold_limit_s = 30`
(the default before this round), and `pace = "decoupled"`. Runs alternate
(scenario, then policy, `--runs` times); the table shows medians over the
runs of the sum of the trainers' wall times (what a sweep's GPUs are held
for), that sum against the best of the explicit policies, the
broker's CPU (pipeline and replay together) and the samples replayed,
and whether every trainer read every batch it asked for with no error.

The bound: the pipeline here is one worker thread on a 2-core machine
(the default: every core but one), so all three trainers want more images
than it makes (32 images in 2-32 ms is 1,000-16,000 images/s): lockstep
decodes each image once; whatever is replayed costs the same worker.

Usage: python bench/pace.py [--runs 3] [--batches 150] [--stop-s 60]
(the release broker: cargo build --release)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import EXE, REPO, cpu_s, image_stream, print, serve, wait_stopped

POLICIES = [
    ("defaults", {}),
    ('"lockstep" (hold_limit_s 2 s)', {"pace": "lockstep"}),
    ('"lockstep", hold_limit_s = 30', {"pace": "lockstep", "hold_limit_s": 30}),
    ('"decoupled"', {"pace": "decoupled"}),
]
STEPS_MS = [2, 8, 32]
SCENARIOS = ["steps", "pauses", "stopped"]


def photos() -> Path:
    root = Path(tempfile.gettempdir()) / "batchcast-pace-photos"
    if not (root / ".done").exists():
        subprocess.run([str(REPO / ".venv/bin/python"), str(REPO / "bench/prepare_photos.py"), str(root),
                        "--crops", "4"], check=True, stdout=subprocess.DEVNULL)
        (root / ".done").write_text("")
    return root


def one(root: Path, scenario: str, keys: dict, batches: int, stop_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        broker, sock = serve(folder, image_stream("train", root, 32, min_consumers=3, **keys))
        try:
            trainers = []
            t0 = time.monotonic()
            for k, step in enumerate(STEPS_MS):
                args = [EXE, "consume", "--socket", str(sock), "--json", "--sleep-ms", str(step),
                        "--max-batches", str(batches), "--name", f"{step}ms"]
                if scenario == "pauses":
                    args += ["--stall-after", str(10 + 15 * k), "--stall-every", "50", "--stall-ms", "5000"]
                if scenario == "stopped" and k == 1:
                    args += ["--stop-after", "20"]
                trainers.append(subprocess.Popen(args, stdout=subprocess.PIPE, text=True))
            if scenario == "stopped":
                wait_stopped(trainers[1].pid)
                time.sleep(stop_s)
                os.kill(trainers[1].pid, signal.SIGCONT)
            walls, reports = [], []
            for p in trainers:
                out, _ = p.communicate(timeout=1800)
                walls.append(time.monotonic() - t0)
                reports.append(json.loads(out))
            stats = json.loads(subprocess.run([EXE, "stats", "--socket", str(sock), "--json"],
                                              capture_output=True, text=True, check=True).stdout)
            st = stats["streams"][0]
            replayed = sum(c.get("replayed", 0) for c in st["consumers"] + st["past_consumers"])
            return {
                "sum_s": sum(walls),
                "cpu_s": cpu_s(broker.pid),
                "replayed": replayed,
                "ok": all(r["ok"] and r["batches"] == batches and not r.get("error_code") for r in reports),
            }
        finally:
            broker.terminate()
            broker.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--stop-s", type=float, default=60)
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    args = ap.parse_args()
    root = photos()
    scenarios = args.scenarios
    results = {(s, p): [] for s in scenarios for p, _ in POLICIES}
    for run in range(args.runs):
        for scenario in scenarios:
            for name, keys in POLICIES:
                r = one(root, scenario, keys, args.batches, args.stop_s)
                results[(scenario, name)].append(r)
                print(f"run {run + 1}/{args.runs} {scenario} {name}: trainers' wall summed {r['sum_s']:.1f} s, "
                      f"broker CPU {r['cpu_s']:.1f} s, replayed {r['replayed']}, ok {r['ok']}")
    med = {k: {m: statistics.median(r[m] for r in rs) for m in ("sum_s", "cpu_s", "replayed")}
           for k, rs in results.items()}
    print()
    print("| scenario | policy | trainers' wall s, summed (median) | against the best explicit | broker CPU s | samples replayed | all read, no error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | :-: |")
    for scenario in scenarios:
        best = min(med[(scenario, p)]["sum_s"] for p, _ in POLICIES[1:])
        for name, _ in POLICIES:
            m = med[(scenario, name)]
            ok = all(r["ok"] for r in results[(scenario, name)])
            print(f"| {scenario} | {name} | {m['sum_s']:.1f} | {m['sum_s'] / best:.2f} | {m['cpu_s']:.1f} | "
                  f"{m['replayed']:.0f} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
