"""Restart chaos: the broker SIGKILLed and started again at random moments
under Rust and Python consumers of a decoupled synthetic stream and a
lockstep image stream. Every consumer must finish without an error, with
every sample of every epoch once and the per-epoch digests of an
uninterrupted run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from conftest import LIMIT, python_child, report

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 3
SYNTHETIC_LEN = 600

# Sample by sample, so that its digest does not depend on the batch size.
PY_CONSUMER = """
import batchcast, hashlib, json, sys, time
socket, stream, batch, sleep = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
c = batchcast.Consumer(stream=stream, socket=socket, output="numpy", batch_size=batch, resume=(0, 0))
epochs = []
while not c.ended:
    h, n, epoch = hashlib.sha256(), 0, None
    for b in c:
        epoch = b.epoch
        fields = [b[k] for k in range(len(b))]
        for j in range(b.samples):
            for f in fields:
                h.update(f[j].tobytes())
        n += b.samples
        time.sleep(sleep)
    if epoch is not None:
        epochs.append([epoch, n, h.hexdigest()])
print(json.dumps({"epochs": epochs}))
"""


def config(root: Path, dec_min: int) -> str:
    return f"""
[[stream]]
name = "dec"
batch_size = 10
epochs = {EPOCHS}
slots = 12
max_batch_size = 16
min_consumers = {dec_min}
drop_last = false
workers = 2
seed = 11
pace = "decoupled"
[stream.synthetic]
len = {SYNTHETIC_LEN}
fill = "full"
fields = [{{ name = "image", dtype = "u8", shape = [3, 8, 8] }}, {{ name = "label", dtype = "i64", shape = [] }}]

[[stream]]
name = "img"
batch_size = 6
epochs = {EPOCHS}
slots = 4
drop_last = false
workers = 2
seed = 12
[stream.image_folder]
root = "{root}"
[stream.transform]
random_resized_crop = {{ size = 32 }}
horizontal_flip = 0.5
"""


def start_consumers(broker, slow: bool) -> dict:
    """The three consumers; `slow`: each reads for about 5 s (114, 33 and
    180 batches), long enough for three restarts."""

    def ride(ms: int) -> list:
        return ["--digest", "--resume", "0:0", "--sleep-ms", str(ms if slow else 0)]

    return {
        "rust dec 16": broker.rust_consumer("--stream", "dec", "--batch-size", "16", *ride(40)),
        "rust img 6": broker.rust_consumer("--stream", "img", *ride(150)),
        "python dec 10": python_child(PY_CONSUMER, broker.socket, "dec", "10", "0.025" if slow else "0"),
    }


def results(procs: dict) -> dict:
    out = {}
    for name, p in procs.items():
        if name.startswith("python"):
            stdout, stderr = p.communicate(timeout=LIMIT)
            assert p.returncode == 0, f"{name} failed:\n{stderr}"
            r = json.loads(stdout.strip().splitlines()[-1])
            out[name] = ([tuple(e) for e in r["epochs"]], stderr.count("is back after"))
        else:
            r = report(p)
            assert r["ok"] and r["ended"], f"{name}: {r}"
            out[name] = ([(e["epoch"], e["samples"], e["digest"]) for e in r["epochs"]], r["reconnects"])
    return out


def test_consumers_ride_through_three_random_sigkills(start_broker, tmp_path):
    root = tmp_path / "images"
    made = subprocess.run(
        [sys.executable, str(REPO / "tests/images/imgtool.py"), "make-folder", str(root), "--count", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    images = int(made.stdout.strip())
    # The uninterrupted run.
    broker = start_broker(config(root, 2))
    want = {name: epochs for name, (epochs, _) in results(start_consumers(broker, slow=False)).items()}
    broker.stop()
    for name, epochs in want.items():
        n = images if "img" in name else SYNTHETIC_LEN
        assert [(e, s) for e, s, _ in epochs] == [(e, n) for e in range(EPOCHS)], (name, epochs)

    # The same consumers, slower, while the broker is SIGKILLed three times
    # at random moments (the seed is printed: a failure can be replayed).
    seed = int(time.time())
    rng = random.Random(seed)
    print(f"restart chaos seed {seed}")
    broker = start_broker(config(root, 2))
    procs = start_consumers(broker, slow=True)
    for k in range(3):
        # Each one back and reading (a consumer still reconnecting when
        # the broker dies again would count one reconnect for two kills).
        broker.wait_for(
            "every consumer to read on",
            lambda s: [len(st["consumers"]) for st in s["streams"]] == [2, 1]
            and all(c["delivered"] >= 1 for st in s["streams"] for c in st["consumers"]),
        )
        time.sleep(rng.uniform(0.0, 0.3))
        broker.kill()
        time.sleep(rng.uniform(0.0, 0.2))
        # A restarted broker serves the resuming consumers whoever comes first.
        broker = start_broker(config(root, 1))
    got = results(procs)
    broker.stop()
    for name, (epochs, reconnects) in got.items():
        assert epochs == want[name], f"seed {seed}: {name} differs from the uninterrupted run"
        assert reconnects == 3, f"seed {seed}: {name} reconnected {reconnects} times"
