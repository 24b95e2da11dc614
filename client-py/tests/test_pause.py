"""A Python trainer stopped mid-step while its loop body holds its batch
(as a PyTorch loop's does until the next batch replaces it), at the
defaults: the others are held at most the 2 s hold limit, and continued,
it reads every sample once. The real broker, a real child process that
SIGSTOPs itself, a steady consumer beside it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import batchcast
from conftest import LIMIT, python_child, synthetic

PAUSED = r"""
import hashlib, json, os, signal, sys
import batchcast
c = batchcast.Consumer(socket=sys.argv[1], output="numpy", name="paused")
h, n = hashlib.sha256(), 0
while not c.ended:
    for batch in c:
        h.update(batch[0].tobytes())
        h.update(batch[1].tobytes())
        n += 1
        if n == 5:
            # Stopped mid-step: `batch` is still held.
            os.kill(os.getpid(), signal.SIGSTOP)
print(json.dumps({"batches": n, "digest": h.hexdigest()}))
"""


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_python_trainer_stopped_holding_its_batch_holds_the_others_at_most_2_s_and_reads_on(start_broker):
    cfg = synthetic(batch=8, length=400, epochs=8, slots=6, min_consumers=2)
    assert "limit" not in cfg and "pace" not in cfg, cfg
    broker = start_broker(cfg)
    child = python_child(PAUSED, broker.socket)
    steady = batchcast.Consumer(socket=broker.socket, output="numpy", name="steady", connect_timeout=30)
    h, n, after_stop = hashlib.sha256(), 0, []

    def read() -> None:
        nonlocal n
        while not steady.ended:
            for batch in steady:
                h.update(batch[0].tobytes())
                h.update(batch[1].tobytes())
                n += 1
                if stopped(child.pid) and not after_stop:
                    after_stop.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    held = reader.is_alive()
    finished = time.monotonic()
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=LIMIT)
    assert not held, f"the steady reader was held while the other was stopped ({n} batches)"
    assert after_stop, "the trainer stopped before the steady reader finished"
    # Alone about 0.1 s; the bound 2 s; slack for a loaded machine.
    assert finished - after_stop[0] < 6.0, finished - after_stop[0]
    assert child.returncode == 0, err
    paused = json.loads(out.strip().splitlines()[-1])
    assert paused == {"batches": n, "digest": h.hexdigest()}, "every sample once, the same bytes"
    s = broker.stream("train")
    assert s["ring_moves"] >= 1 and s["detached"] == 0, s
