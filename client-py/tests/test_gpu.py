"""The GPU client side on a host with a CUDA GPU and PyTorch: the device
arena opened over CUDA IPC, the page-locked host arena copied once per
batch, and a device batch's slot given back only after the work queued
on the stream it was imported on has run. Skipped (and counted as a skip)
elsewhere; `bench/gpu.sh` runs it on the GPU host."""

from __future__ import annotations

import threading
from typing import List

import pytest

from conftest import synthetic


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not _cuda(), reason="no CUDA GPU visible to PyTorch on this host")

BATCHES = 48


def _checksum(t):
    """A position-weighted sum of a field's elements, computed where the
    tensor lives (queued on the current CUDA stream for a device tensor)."""
    import torch

    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return (flat * weights).sum()


def _host_sums(consumer, out: List[List[int]]) -> None:
    for batch in consumer:
        out.append([int(_checksum(batch[k])) for k in ("image", "label")])


@needs_gpu
def test_device_batches_match_the_host_and_go_back_only_after_the_work_queued_on_their_stream(start_broker):
    import torch

    import batchcast

    # Two device slots: a slot given back before its reader ran would be
    # refilled under it within two batches.
    broker = start_broker(
        synthetic(
            batch=64,
            length=64 * BATCHES,
            epochs=1,
            min_consumers=2,
            extra="gpu_slots = 2",
            fields='{ name = "image", dtype = "u8", shape = [3, 64, 64] }, { name = "label", dtype = "i64", shape = [] }',
        )
    )
    host = batchcast.Consumer(socket=broker.socket, device="cpu", window=4, name="host")
    expected: List[List[int]] = []
    reader = threading.Thread(target=_host_sums, args=(host, expected))
    reader.start()
    dev = batchcast.Consumer(socket=broker.socket, device="cuda:0", window=2, name="gpu")
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for batch in dev:
            fields = [batch["image"], batch["label"]]
            assert all(f.is_cuda for f in fields)
            # Imported on `side`: GPU work queued there reads the batch
            # after a delay, and the batch is released at once.
            torch.cuda._sleep(20_000_000)
            sums.append([_checksum(f) for f in fields])
            del fields
            batch.release()
    torch.cuda.synchronize()
    reader.join(60)
    assert not reader.is_alive(), "the host consumer did not finish"
    got = [[int(s) for s in row] for row in sums]
    assert len(got) == len(expected) == BATCHES
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not bad, f"device batches {bad} differ from the host's (a slot was refilled under a queued read?)"
    gpus = broker.stream("train")["gpus"]
    # One copy per batch, from the page-locked host arena.
    assert len(gpus) == 1 and gpus[0]["copies"] == BATCHES and gpus[0]["pinned"], gpus
