"""Pipeline threads matched to demand (`workers` left out) against fixed
`workers` settings swept by hand: one trainer reads an endless image
stream of real photographs (bench/prepare_photos.py; RandomResizedCrop(224)
+ flip + Normalize, batches of 32, the decoded cache off so that every
epoch costs the same) at three demands: a quarter, a half and all of what
the host decodes with every core (measured first, with `workers` at every
core), the trainer sleeping that much per batch. Each run lasts `--secs`
seconds of the trainer reading; runs alternate (demand, then setting,
`--runs` times) and the table shows medians: the trainer's images/s, the
broker's CPU seconds per second (its pipeline), those against the best
fixed setting's (the one of the most images/s, then the least CPU), and,
for the automatic threads, how many worked at the end and how long after
the trainer started the count last changed (settling); then, for the
automatic threads, demand changing from a quarter to all and back (a slow
trainer leaving a fast one, and another joining), and how long after each
change the count settled.

The bound: a fixed setting above what the demand needs makes the same
images with the same work per image; its extra threads wait for slots
(no CPU), so the CPU of the best fixed setting is the floor, and the
automatic count can only match it, minus what waking more threads than
needed costs. Below what the demand needs, images/s fall short.

Usage: python bench/threads.py [--runs 3] [--secs 10] [--dataset DIR]
(the release broker: cargo build --release)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import EXE, REPO, cpu_s, image_stream, print, serve

BATCH = 32


def stats(sock: Path) -> dict:
    out = subprocess.run([EXE, "stats", "--socket", str(sock), "--json"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)["streams"][0]


def one(root: Path, keys: dict, sleep_ms: float, secs: float) -> dict:
    """One trainer sleeping `sleep_ms` a batch for about `secs` seconds on
    a broker whose stream has `keys`."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        share = keys.pop("max_cpu_share", None)
        toml = image_stream("train", root, BATCH, seed=1, decoded_cache_mib=0, **keys)
        if share is not None:
            toml = f"[broker]\nmax_cpu_share = {share}\n" + toml
        broker, sock = serve(folder, toml)
        try:
            cpu0 = cpu_s(broker.pid)
            t0 = time.monotonic()
            trainer = subprocess.Popen([EXE, "consume", "--socket", str(sock), "--json", "--sleep-ms",
                                        str(int(round(sleep_ms))), "--max-batches", "100000"],
                                       stdout=subprocess.PIPE, text=True)
            counts, last_change, working = [], 0.0, None
            while time.monotonic() - t0 < secs:
                time.sleep(0.25)
                st = stats(sock)
                n = st.get("workers_active", st["workers"])
                if n != working:
                    working, last_change = n, time.monotonic() - t0
                counts.append(n)
            st = stats(sock)
            wall = time.monotonic() - t0
            cpu = cpu_s(broker.pid) - cpu0
            trainer.terminate()
            trainer.communicate(timeout=60)
            produced = st["batches_produced"] * BATCH
            return {"images_s": produced / wall, "cpu_per_s": cpu / wall, "working": working,
                    "settled_s": last_change, "threads": st["workers"]}
        finally:
            broker.terminate()
            broker.wait()


def changes(root: Path, capacity: float, secs: float) -> dict:
    """The automatic threads as demand changes, `secs` seconds a phase: a
    trainer at a quarter of `capacity` beside one taking all it can (the
    slow one sets the pace, as the default pace does: a quarter), then the
    slow one leaves (all), then a slow one joins again (a quarter): the
    threads working at the end of each phase and how long after its change
    the count last changed."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        toml = "[broker]\nmax_cpu_share = 1.0\n" + image_stream("train", root, BATCH, seed=1, decoded_cache_mib=0,
                                                                 min_consumers=2)
        broker, sock = serve(folder, toml)
        slow_ms = str(int(round(1000.0 * BATCH / (0.25 * capacity))))

        def trainer(sleep: str) -> subprocess.Popen:
            return subprocess.Popen([EXE, "consume", "--socket", str(sock), "--json", "--sleep-ms", sleep,
                                     "--max-batches", "100000"], stdout=subprocess.PIPE, text=True)

        try:
            slow, fast = trainer(slow_ms), trainer("0")
            phases = []
            for phase in ("a quarter (the slow one sets the pace)", "all (the slow one left)",
                          "a quarter (a slow one joined)"):
                if phase.startswith("all"):
                    slow.terminate()
                    slow.communicate(timeout=60)
                if phase.endswith("joined)"):
                    slow = trainer(slow_ms)
                t0, working, last = time.monotonic(), None, 0.0
                while time.monotonic() - t0 < secs:
                    time.sleep(0.25)
                    n = stats(sock).get("workers_active")
                    if n != working:
                        working, last = n, time.monotonic() - t0
                phases.append((phase, working, last))
            for p in (slow, fast):
                p.terminate()
                p.communicate(timeout=60)
            return {p: (n, t) for p, n, t in phases}
        finally:
            broker.terminate()
            broker.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--secs", type=float, default=10)
    ap.add_argument("--dataset", type=Path, default=Path(tempfile.gettempdir()) / "photos-imagenet")
    args = ap.parse_args()
    if not args.dataset.exists():
        subprocess.run([str(REPO / ".venv/bin/python"), str(REPO / "bench/prepare_photos.py"), str(args.dataset)],
                       check=True)
    cores = os.cpu_count() or 1
    full = one(args.dataset, {"workers": cores}, 0, args.secs)
    capacity = full["images_s"]
    print(f"{args.dataset}: {cores} cores decode {capacity:.0f} images/s with workers = {cores}")
    demands = [("a quarter", 0.25), ("a half", 0.5), ("all", 1.0)]
    settings = [(f"workers = {n}", {"workers": n}) for n in range(1, cores + 1)]
    settings.append(("left out ([broker] max_cpu_share = 1)", {"max_cpu_share": 1.0}))
    results = {(d, s): [] for d, _ in demands for s, _ in settings}
    for run in range(args.runs):
        for dname, frac in demands:
            sleep_ms = 0.0 if frac >= 1.0 else 1000.0 * BATCH / (frac * capacity)
            for sname, keys in settings:
                r = one(args.dataset, dict(keys), sleep_ms, args.secs)
                results[(dname, sname)].append(r)
                print(f"run {run + 1}/{args.runs}, demand {dname} ({sleep_ms:.1f} ms a batch), {sname}: "
                      f"{r['images_s']:.0f} images/s, broker {r['cpu_per_s']:.2f} CPU-s/s, "
                      f"{r['working']} of {r['threads']} working, last change at {r['settled_s']:.1f} s")
    print()
    print("| demand | workers | images/s | broker CPU-s per s | images/s against the best fixed | CPU against it "
          "| threads working at the end | settled after s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dname, _ in demands:
        med = {s: {k: statistics.median(r[k] for r in results[(dname, s)])
                   for k in ("images_s", "cpu_per_s", "working", "settled_s")} for s, _ in settings}
        fixed = [s for s, _ in settings[:-1]]
        top = max(med[s]["images_s"] for s in fixed)
        # The best fixed setting: within 2 % of the most images/s, the least CPU.
        best = min((s for s in fixed if med[s]["images_s"] >= 0.98 * top), key=lambda s: med[s]["cpu_per_s"])
        for s, _ in settings:
            m = med[s]
            auto = s == settings[-1][0]
            print(f"| {dname} | {s}{' (best fixed)' if s == best else ''} | {m['images_s']:.0f} | "
                  f"{m['cpu_per_s']:.2f} | {m['images_s'] / med[best]['images_s']:.2f} | "
                  f"{m['cpu_per_s'] / med[best]['cpu_per_s']:.2f} | "
                  f"{m['working']:.0f} | {m['settled_s']:.1f} |" if auto else
                  f"| {dname} | {s}{' (best fixed)' if s == best else ''} | {m['images_s']:.0f} | "
                  f"{m['cpu_per_s']:.2f} | {m['images_s'] / med[best]['images_s']:.2f} | "
                  f"{m['cpu_per_s'] / med[best]['cpu_per_s']:.2f} | | |")
    print()
    print("| run | phase | threads working at its end | its count last changed after s |")
    print("| --- | --- | ---: | ---: |")
    for run in range(args.runs):
        for phase, (n, t) in changes(args.dataset, capacity, args.secs).items():
            print(f"| {run + 1} | {phase} | {n} | {t:.1f} |")


if __name__ == "__main__":
    main()
