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
    return dec_config(dec_min) + f"""
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


def dec_config(dec_min: int) -> str:
    """A finite decoupled synthetic stream waiting for `dec_min` consumers,
    read in the stream's order (`rotate_epochs = false`: the checkpoint
    test compares each epoch's digest, in order, with an uninterrupted
    run's; a rotated epoch holds the same samples in another order)."""
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
rotate_epochs = false
[stream.synthetic]
len = {SYNTHETIC_LEN}
fill = "full"
fields = [{{ name = "image", dtype = "u8", shape = [3, 8, 8] }}, {{ name = "label", dtype = "i64", shape = [] }}]
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


# A trainer that checkpoints after every batch: its `state_dict()`, the
# epochs it finished, and the one it is in, whose digest is a chain
# (h = sha256(h, sample)) so that it can be saved and carried on. Started
# again on the same checkpoint it goes on from there.
CHECKPOINTING_TRAINER = """
import batchcast, hashlib, json, os, sys, time
socket, stream, batch, sleep, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
saved = None
if os.path.exists(ckpt):
    with open(ckpt) as f:
        saved = json.load(f)
state, done, cur = (saved["state"], saved["done"], saved["cur"]) if saved else (None, [], None)
c = batchcast.Consumer(stream=stream, socket=socket, output="numpy", batch_size=batch,
                       state=state, resume=None if state else (0, 0), connect_timeout=30)
while not c.ended:
    for b in c:
        if cur is None or cur[0] != b.epoch:
            if cur is not None:
                done.append(cur)
            cur = [b.epoch, 0, "00" * 32]
        h = bytes.fromhex(cur[2])
        fields = [b[k] for k in range(len(b))]
        for j in range(b.samples):
            m = hashlib.sha256(h)
            for f in fields:
                m.update(f[j].tobytes())
            h = m.digest()
        cur = [b.epoch, cur[1] + b.samples, h.hex()]
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"state": c.state_dict(), "done": done, "cur": cur}, f)
        os.replace(ckpt + ".tmp", ckpt)
        time.sleep(sleep)
if cur is not None:
    done.append(cur)
print(json.dumps({"epochs": done}))
"""

# Batch size and seconds per batch of each trainer of the finite
# decoupled stream (about 7.2, 6.8 and 6.4 s alone when slow).
TRAINERS = {"t10": (10, 0.04), "t16": (16, 0.06), "t7": (7, 0.025)}


def trainer(broker, name: str, ckpt: Path, slow: bool):
    batch, sleep = TRAINERS[name]
    return python_child(CHECKPOINTING_TRAINER, broker.socket, "dec", str(batch), str(sleep if slow else 0), str(ckpt))


def trainer_epochs(p) -> list:
    stdout, stderr = p.communicate(timeout=LIMIT)
    assert p.returncode == 0, stderr
    return [tuple(e) for e in json.loads(stdout.strip().splitlines()[-1])["epochs"]]


def test_trainers_killed_and_resumed_from_checkpoints_read_every_epoch_once(start_broker, tmp_path):
    """A finite decoupled stream, its broker SIGKILLed twice and its
    trainers SIGKILLed three times at random moments, each started again
    from its checkpoint; the last one killed is started again only after
    the others finished (the stream made to its end: it is served from
    replay). Every trainer's epochs are those of an uninterrupted run:
    every sample of every epoch once, in order."""
    broker = start_broker(dec_config(len(TRAINERS)))
    procs = {n: trainer(broker, n, tmp_path / f"ref-{n}.json", slow=False) for n in TRAINERS}
    want = {n: trainer_epochs(p) for n, p in procs.items()}
    broker.stop()
    for n, epochs in want.items():
        assert [(e, s) for e, s, _ in epochs] == [(e, SYNTHETIC_LEN) for e in range(EPOCHS)], (n, epochs)

    seed = int(time.time())
    rng = random.Random(seed)
    print(f"checkpoint chaos seed {seed}")
    ckpt = {n: tmp_path / f"{n}.json" for n in TRAINERS}
    broker = start_broker(dec_config(len(TRAINERS)))
    procs = {n: trainer(broker, n, ckpt[n], slow=True) for n in TRAINERS}
    names = list(TRAINERS)

    def saved_batches() -> int:
        return sum(json.loads(p.read_text())["cur"][1] for p in ckpt.values() if p.exists())

    # Broker, trainer, broker, trainer: each after some more progress.
    for event in ["broker", "trainer", "broker", "trainer"]:
        before, t0 = saved_batches(), time.monotonic()
        while saved_batches() == before:
            assert time.monotonic() - t0 < LIMIT, f"seed {seed}: nobody reads on"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.1, 0.6))
        if event == "broker":
            broker.kill()
            time.sleep(rng.uniform(0.0, 0.2))
            broker = start_broker(dec_config(1))
        else:
            n = rng.choice([n for n in names if procs[n].poll() is None])
            procs[n].kill()
            procs[n].communicate()
            time.sleep(rng.uniform(0.0, 0.3))
            procs[n] = trainer(broker, n, ckpt[n], slow=True)
    # The third: killed, and started again once the others finished.
    late = rng.choice([n for n in names if procs[n].poll() is None])
    procs[late].kill()
    procs[late].communicate()
    got = {n: trainer_epochs(p) for n, p in procs.items() if n != late}
    got[late] = trainer_epochs(trainer(broker, late, ckpt[late], slow=False))
    broker.stop()
    for n in TRAINERS:
        assert got[n] == want[n], f"seed {seed}: {n} differs from the uninterrupted run: {got[n]}"
