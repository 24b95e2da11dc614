"""What one paused trainer costs the others at the defaults: a steady
trainer reads 1,500 batches of a synthetic stream (64 × 3×32×32 u8 and a
label, stamped) while a second one, subscribed with it, is SIGSTOPped after
5 batches for 40 s, then continued and read to 300 batches. Each policy is
the same config but for its hold keys; the policies alternate, `--runs`
times each, and the table shows medians and ranges of the steady trainer's
wall time (alone it is well under a second), whether both read every
sample with the generator's bytes (`--verify`), and how many batches the
broker replayed to the paused one (`stats`).

The bound: the steady trainer waits for the paused one at most the
hold bound that applies (the paused one holds no batch: `consume` releases
each before the next), then reads on; the paused one, cut, is replayed
what it missed. With `--hold`, the paused one keeps its last batch while
stopped (`consume --hold 1`, as a training step holds its batch): the
ring moves on without it at the same bound.

Usage: python bench/pause.py [--runs 3] [--hold]   (the release broker: cargo build --release)
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

from _common import EXE, print, serve, wait_stopped

POLICIES = [
    ("defaults (hold_limit_s 2 s)", ""),
    ("hold_limit_s = 30 (the default before)", "hold_limit_s = 30\n"),
    ('pace = "decoupled"', 'pace = "decoupled"\n'),
]

STREAM = """
[[stream]]
name = "train"
batch_size = 64
min_consumers = 2
{keys}
[stream.synthetic]
len = 6400
fill = "stamp"
fields = [
  {{ name = "image", dtype = "u8", shape = [3, 32, 32] }},
  {{ name = "label", dtype = "i64", shape = [] }},
]
"""


def one(keys: str, hold: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        broker, sock = serve(folder, STREAM.format(keys=keys))
        try:
            common = [EXE, "consume", "--socket", str(sock), "--json", "--verify"]
            steady = subprocess.Popen(common + ["--max-batches", "1500", "--name", "steady"],
                                      stdout=subprocess.PIPE, text=True)
            holds = ["--hold", "1"] if hold else []
            paused = subprocess.Popen(common + holds + ["--max-batches", "300", "--stop-after", "5", "--name", "paused"],
                                      stdout=subprocess.PIPE, text=True)
            wait_stopped(paused.pid)
            stopped_at = time.monotonic()
            s_out, _ = steady.communicate(timeout=120)
            time.sleep(max(0.0, stopped_at + 40 - time.monotonic()))
            os.kill(paused.pid, signal.SIGCONT)
            p_out, _ = paused.communicate(timeout=120)
            if not s_out.strip() or not p_out.strip():
                raise SystemExit(f"a trainer printed no report: steady exit {steady.returncode}, "
                                 f"paused exit {paused.returncode}")
            s, p = json.loads(s_out), json.loads(p_out)
            stats = json.loads(subprocess.run([EXE, "stats", "--socket", str(sock), "--json"],
                                              capture_output=True, text=True, check=True).stdout)
            past = stats["streams"][0]["past_consumers"]
            replayed = sum(c.get("replayed", 0) for c in past if c["name"] == "paused")
            moves = stats["streams"][0].get("ring_moves", 0)
            return {
                "steady_s": s["seconds"],
                "ok": s["ok"] and s["verified_samples"] == s["samples"] and p["ok"]
                and p["verified_samples"] == p["samples"] and p["batches"] == 300,
                "replayed": replayed,
                "paused_error": p.get("error_code"),
                "moves": moves,
            }
        finally:
            broker.terminate()
            broker.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hold", action="store_true", help="the paused trainer keeps its last batch while stopped")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {name: [] for name, _ in POLICIES}
    for run in range(args.runs):
        for name, keys in POLICIES:
            r = one(keys, args.hold)
            print(f"run {run + 1}/{args.runs} {name}: steady {r['steady_s']:.2f} s, ok {r['ok']}, "
                  f"replayed {r['replayed']}, ring moves {r['moves']}, paused one's error {r['paused_error']}")
            results[name].append(r)
    print()
    print("| policy | steady trainer's wall s, median (range) | every sample, both | samples replayed to the paused one (median) | ring moves (median) |")
    print("| --- | ---: | :-: | ---: | ---: |")
    for name, rs in results.items():
        walls = [r["steady_s"] for r in rs]
        print(f"| {name} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
              f"{'yes' if all(r['ok'] for r in rs) else 'NO'} | {statistics.median(r['replayed'] for r in rs):.0f} | "
              f"{statistics.median(r['moves'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
