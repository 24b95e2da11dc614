"""The device= option on hosts without a GPU (CI), and what it shares with
the GPU path: host views, private copies, argument checks. The GPU path
itself is exercised by bench/gpu.sh on a GPU host."""

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
