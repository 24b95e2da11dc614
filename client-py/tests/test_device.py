"""The device= option on hosts without a GPU (CI), and what it shares with
the GPU path: host views, private copies, argument checks; and device
consumers on the host-memory stand-in for a GPU (BATCHCAST_TEST_GPU), with
a host consumer's capabilities (their own batch size, a state_dict()
resume, join now, group ranks). CUDA itself is exercised by bench/gpu.sh
on a GPU host."""

from __future__ import annotations

import ctypes.util
import os

import numpy as np
import pytest

import batchcast
from conftest import needs_torch, synthetic

NO_DRIVER = ctypes.util.find_library("cuda") is None and not os.path.exists("/dev/nvidiactl")
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="this host has a CUDA driver")


@needs_no_driver
def test_a_gpu_consumer_without_a_driver_is_told_and_host_consumers_are_unaffected(start_broker):
    broker = start_broker(synthetic(epochs=1))
    with pytest.raises(batchcast.DeviceUnavailable) as e:
        if _torch():
            batchcast.Consumer(socket=broker.socket, device="cuda:0")
        else:  # the package needs torch for GPU tensors: ask the binding
            batchcast._native.Consumer("train", socket=str(broker.socket), device="cuda:0")
    text = str(e.value)
    assert "no CUDA driver" in text and 'device="cpu"' in text, text
    c = batchcast.Consumer(socket=broker.socket, output="numpy", device="cpu")
    assert c.device == "cpu"
    batches = [labels.copy() for _, labels in c]
    assert len(batches) == len(c) == 13
    assert broker.stream("train")["gpus"] == []


def test_bad_devices_are_invalid_arguments(start_broker):
    broker = start_broker(synthetic(epochs=1))
    for bad in ["tpu", "cuda:", "cuda:-1", True]:
        with pytest.raises(batchcast.InvalidArgument) as e:
            batchcast.Consumer(socket=broker.socket, output="numpy", device=bad)
        assert "cuda:N" in str(e.value) or "device=" in str(e.value), (bad, str(e.value))
    with pytest.raises(batchcast.InvalidArgument) as e:
        batchcast.Consumer(socket=broker.socket, output="numpy", device="cuda:0")
    assert "output='numpy' cannot hold GPU memory" in str(e.value)


def test_copy_true_gives_private_writable_arrays_and_frees_slots(start_broker):
    broker = start_broker(synthetic(epochs=1, min_consumers=2))
    shared = batchcast.Consumer(socket=broker.socket, output="numpy", name="shared", window=4)
    # Its window is 2: if the copies kept below pinned their slots, the
    # third batch could never arrive.
    private = batchcast.Consumer(socket=broker.socket, output="numpy", name="private", copy=True)
    base, length = private.arena
    kept = []
    for (images_p, labels_p), (images_s, labels_s) in zip(private, shared):
        kept.append(images_p)
        ptr = images_p.__array_interface__["data"][0]
        assert not base <= ptr < base + length, "copy=True still points into the arena"
        assert images_p.flags.writeable
        before = images_s.copy()
        images_p += 1  # a private copy: nobody else sees this
        assert np.array_equal(images_s, before)
        assert np.array_equal(images_p, before + 1)
        assert np.array_equal(labels_p, labels_s)
    # Every copy is still alive, and none of them holds a slot.
    assert len(kept) == len(private) and private.held == 0


def test_host_views_are_the_batch_bytes(start_broker):
    broker = start_broker(synthetic(epochs=1))
    c = batchcast.Consumer(socket=broker.socket, output="numpy")
    for batch in c:
        images, labels = batch
        assert np.array_equal(batch.host("image"), images)
        assert np.array_equal(batch.host(1), labels)
        assert not batch.host("image").flags.writeable
        with pytest.raises(KeyError):
            batch.host("nope")


@needs_torch
def test_torch_device_objects_are_accepted(start_broker):
    import torch

    broker = start_broker(synthetic(epochs=1))
    c = batchcast.Consumer(socket=broker.socket, device=torch.device("cpu"))
    assert c.device == "cpu"
    images, _ = next(iter(c))
    assert images.device.type == "cpu"


def _torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# A trainer process on the host-memory stand-in for a GPU (the test setting
# BATCHCAST_TEST_GPU, read once per process: set in a child of its own).
# Each consumer's samples of field 0 by (epoch, sample), from threads of one
# process; device consumers' tensors lie in the stand-in's "device memory".
_STAND_IN_TRAINERS = r"""
import json, sys, threading
import batchcast

sock, epochs, plan = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
seen, errors, devices = {}, [], {}

def run(name, kw, stop_after=None):
    try:
        got = seen.setdefault(name, {})
        state = read(name, kw, got, stop_after)
        if state is not None:  # a new trainer goes on from its state
            run(name + "+", dict(kw, state=state, batch_size=None))
    except Exception as e:  # reported to the test
        errors.append(f"{name}: {e!r}")

def read(name, kw, got, stop_after):
    c = batchcast.Consumer(socket=sock, output="torch", name=name, **kw)
    devices[name] = c.device
    n = 0
    for _ in range(epochs):  # an iteration is an epoch (a resumed one: its rest)
        for b in c:
            x = b[0].contiguous().numpy()
            for j in range(b.samples):
                got[f"{b.epoch}:{b.first_sample + j}"] = x[j].tobytes().hex()
            n += 1
            if n == stop_after:
                return c.state_dict()  # the trainer stops: its consumer goes

threads = [threading.Thread(target=run, args=(n, kw, s)) for n, kw, s in plan]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"seen": seen, "errors": errors, "devices": devices}))
"""


def _stand_in_trainers(broker, epochs: int, plan) -> dict:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _STAND_IN_TRAINERS, str(broker.socket), str(epochs), json.dumps(plan)],
        env={**os.environ, "BATCHCAST_TEST_GPU": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["errors"] == [], got["errors"]
    return got


@needs_torch
def test_device_consumers_on_the_gpu_stand_in_take_their_batch_size_and_resume_from_a_state(start_broker):
    # A device consumer of batches of 7 stops after 5, keeps its
    # state_dict(), and a new one goes on from it (replayed to its GPU);
    # together they read a host consumer's bytes, every sample once.
    broker = start_broker(synthetic(epochs=2, slots=8, min_consumers=2), env={"BATCHCAST_TEST_GPU": "1"})
    got = _stand_in_trainers(
        broker,
        2,
        [
            ["host", {}, None],
            ["gpu", {"device": "cuda:0", "batch_size": 7}, 5],
        ],
    )
    host, first, rest = got["seen"]["host"], got["seen"]["gpu"], got["seen"]["gpu+"]
    assert len(host) == 200 and len(first) == 35, (len(host), len(first))
    assert not set(first) & set(rest), "every sample once"
    assert {**first, **rest} == host, "a host consumer's bytes"
    # Its tensors lie in the stand-in's memory, which is host memory.
    assert got["devices"]["gpu"] == "cpu", got["devices"]
    gpus = broker.stream("train")["gpus"]
    # What it missed was replayed to its GPU. (A unit copied for the
    # first trainer, which left before reading it, is copied again for
    # the second: the one-copy-per-unit bound is for trainers reading
    # together, tests/device.rs.)
    assert len(gpus) == 1 and gpus[0]["copies"] > 0 and gpus[0]["replayed"] > 0, gpus


@needs_torch
def test_device_consumers_on_the_gpu_stand_in_join_now_and_split_an_epoch_as_a_group(start_broker):
    # Two ranks of a group on two stand-in GPUs, joining now: each reads
    # its own share, together every sample once, a host consumer's bytes.
    broker = start_broker(synthetic(epochs=1, slots=8, min_consumers=3), env={"BATCHCAST_TEST_GPU": "1"})
    member = lambda rank: {"device": f"cuda:{rank}", "join": "now", "group": "trial", "rank": rank, "world": 2}
    got = _stand_in_trainers(broker, 1, [["host", {}, None], ["r0", member(0), None], ["r1", member(1), None]])
    host, r0, r1 = (got["seen"][n] for n in ("host", "r0", "r1"))
    assert len(host) == 100 and r0 and r1, (len(host), len(r0), len(r1))
    assert not set(r0) & set(r1), "a sample to one rank only"
    assert {**r0, **r1} == host, "the group reads the epoch, a host consumer's bytes"
    assert len(broker.stream("train")["gpus"]) == 2
