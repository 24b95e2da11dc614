"""Riding through a broker restart, measured (bench/restart.sh runs it).

Three trainers (Python consumers, a 10 ms step per batch) read two endless
streams (two of them the second, lockstep): the demo images (batches of 32, random-resized-cropped to 112 px,
f32) and a synthetic stream (batches of 64 of 3x64x64 u8). The broker is
SIGKILLed `--restarts` times, once every trainer reads again, and comes back:

* plain: this harness starts a new broker as soon as the old one is gone
  (what a supervisor such as systemd's `Restart=always` does without a
  socket unit); trainers find no socket meanwhile and retry every 20 ms;
* socket-activated: Debian's `systemd-socket-activate` holds the socket and
  a loop starts the broker again on it (a `.socket` unit and
  `Restart=always`); trainers' connections wait in the socket's queue.

Per restart and trainer: the pause (the longest time between two batches
handed to the trainer after the kill, less its usual 10 ms step) and the
trainer's own count from noticing the broker gone to being subscribed
again ("is back after" on its stderr); per run,
the new brokers' replay CPU (what they recomputed to serve the trainers
from their positions: a fresh stream starts where its first trainer
resumes, so only the trainers behind it are replayed to). Medians and worst over every restart, one table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import batchcast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import image_stream  # noqa: E402

TRAINER = """
import json, sys, time, batchcast
socket, stream, out = sys.argv[1], sys.argv[2], sys.argv[3]
c = batchcast.Consumer(stream=stream, socket=socket, output="numpy", reconnect_timeout=60, connect_timeout=30, resume=(0, 0))
with open(out, "w") as f:
    while True:
        for b in c:
            f.write(f"{time.monotonic()}\\n")
            f.flush()
            time.sleep(0.010)
"""


def config(images: Path) -> str:
    images_stream = image_stream(
        "images", images, 32, size=112, shuffle=True, seed=2026, slots=6, drop_last=False, workers=2
    )
    return images_stream + f"""

[[stream]]
name = "synthetic"
batch_size = 64
slots = 8
seed = 7
workers = 1
[stream.synthetic]
len = 100000
fill = "full"
fields = [{{ name = "image", dtype = "u8", shape = [3, 64, 64] }}, {{ name = "label", dtype = "i64", shape = [] }}]
"""


def stats(exe: str, socket: str) -> dict | None:
    r = subprocess.run([exe, "stats", "--json", "--socket", socket], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else None


def wait_reading(exe: str, socket: str, at_least: int = 5) -> dict:
    """Stats once both trainers have been handed `at_least` batches by this broker."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = stats(exe, socket)
        if s and all(any(c["delivered"] >= at_least for c in st["consumers"]) for st in s["streams"]):
            return s
        time.sleep(0.02)
    raise SystemExit("the trainers did not read again within 120 s")


def gone(pid: int) -> None:
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.001)


def run(mode: str, exe: str, images: Path, restarts: int, tmp: Path) -> dict:
    d = Path(tempfile.mkdtemp(dir=tmp))
    (d / "b.toml").write_text(config(images))
    sock = str(d / "b.sock")
    log = open(d / "broker.log", "w")
    serve = [exe, "serve", "--config", str(d / "b.toml")]
    if mode == "plain":
        start = lambda: subprocess.Popen([*serve, "--socket", sock], stdout=log, stderr=subprocess.STDOUT)
        broker = start()
        manager = None
    else:
        loop = 'while :; do bash -c \'export LISTEN_PID=$$; exec "$0" serve --config "$1"\' "$1" "$2"; done'
        manager = subprocess.Popen(
            ["systemd-socket-activate", "-l", sock, "bash", "-c", loop, "manager", exe, str(d / "b.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    while not os.path.exists(sock):
        time.sleep(0.01)
    trainers = {
        name: subprocess.Popen(
            [sys.executable, "-c", TRAINER, sock, name.split("-")[0], str(d / f"{name}.times")],
            stdout=subprocess.DEVNULL,
            stderr=open(d / f"{name}.err", "w"),
        )
        for name in ("images", "synthetic", "synthetic-b")
    }
    kills, replay_cpu = [], 0.0
    try:
        s = wait_reading(exe, sock, 20)
        for _ in range(restarts):
            pid = s["broker_pid"]
            time.sleep(0.3)
            kills.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)
            if mode == "plain":
                broker.wait()
                broker = start()
            else:
                gone(pid)
            s = wait_reading(exe, sock)
            replay_cpu += sum(c.get("replay_cpu_s", 0.0) for st in s["streams"] for c in st["consumers"])
        time.sleep(0.3)
    finally:
        for t in trainers.values():
            t.kill()
            t.wait()
        if mode == "plain":
            broker.terminate()
            broker.wait()
        else:
            manager.kill()
            manager.wait()
            for pid in [(stats(exe, sock) or {}).get("broker_pid")]:
                if pid:
                    os.kill(pid, signal.SIGTERM)
    pauses, backs = [], []
    ends = kills[1:] + [float("inf")]
    for name in trainers:
        times = [float(x) for x in (d / f"{name}.times").read_text().split()]
        step = statistics.median(b - a for a, b in zip(times, times[1:]))
        for k, end in zip(kills, ends):
            # The longest wait for a batch between this kill and the next
            # (batches already received go on being handed out a moment
            # after the kill, so the gap is not always right at it).
            gaps = [b - a for a, b in zip(times, times[1:]) if b > k and a < end]
            if gaps:
                pauses.append(max(gaps) - step)
        # The trainer's own count, from noticing the broker gone to being
        # subscribed again ("is back after S s" on its stderr).
        for line in (d / f"{name}.err").read_text().splitlines():
            if "is back after" in line:
                backs.append(float(line.rsplit("after", 1)[1].split()[0]))
    return {"pauses": pauses, "backs": backs, "replay_cpu": replay_cpu, "restarts": restarts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", required=True)
    p.add_argument("--images", required=True, help="the demo images (batchcast demo makes them)")
    p.add_argument("--restarts", type=int, default=10)
    a = p.parse_args()
    tmp = Path(tempfile.gettempdir())
    rows = []
    for mode in ("plain", "socket-activated"):
        r = run(mode, a.broker, Path(a.images), a.restarts, tmp)
        ms = lambda xs, f: f"{1e3 * f(xs):.0f} ms"
        rows.append(
            (
                mode,
                ms(r["pauses"], statistics.median),
                ms(r["pauses"], max),
                ms(r["backs"], statistics.median),
                ms(r["backs"], max),
                f"{1e3 * r['replay_cpu'] / r['restarts']:.1f} ms",
            )
        )
    print(f"\nbroker SIGKILLed {a.restarts} times under 3 trainers (demo images; 2 on synthetic; 10 ms steps), batchcast {batchcast.__version__}\n")
    print("| restart | pause p50 | pause worst | back (subscribed again) p50 | worst | replay CPU per restart |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
