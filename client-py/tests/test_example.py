"""`examples/train_torch.py` run as a user runs it: a real PyTorch trainer
that starts its own broker, checkpoints mid-epoch (model, optimizer and the
loader's `state_dict()`), is interrupted, and goes on from the checkpoint
with a new broker: it trains on exactly the samples the interrupted run had
not, and its DataLoader variant counts the same samples per epoch."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import LIMIT, REPO, broker_bin, needs_torch, small_image_folder

# 31 batches an epoch, the last short (4): long enough to interrupt it
# mid-epoch, and a DataLoader that drops the short batch counts fewer.
IMAGES = 244
BATCH = 8


def example(*args: str, socket: Path) -> subprocess.Popen:
    # Ctrl-C must reach it as a user's would: a suite started in the
    # background of a script ignores SIGINT, and an ignored signal stays
    # ignored across exec (a handler does not), so one is set around the start.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-u", str(REPO / "examples" / "train_torch.py"), "--socket", str(socket),
             "--batchcast", broker_bin(), "--batch-size", str(BATCH), "--size", "16", "--workers", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
    finally:
        signal.signal(signal.SIGINT, before)


def epochs_seen(out: str) -> dict:
    """Images per epoch, from the example's `epoch N: K images` lines."""
    return {int(e): int(n) for e, n in re.findall(r"^epoch (\d+): (\d+) images", out, re.M)}


@needs_torch
def test_the_torch_example_checkpoints_mid_epoch_and_resumes_exactly_there(tmp_path: Path) -> None:
    import torch

    data = tmp_path / "images"
    small_image_folder(data, IMAGES, seed=5)
    ckpt = tmp_path / "ckpt.pt"
    common = ("--data", str(data), "--epochs", "2", "--checkpoint", str(ckpt))
    # Checkpoints every batch; interrupted (Ctrl-C: it stops its broker)
    # as soon as its first checkpoint (after batch 1 of epoch 0) is on
    # disk. Its steps take 40 ms more (epoch 0 about 1.2 s, against a
    # 10 ms poll of the file): a margin, since the small model alone
    # finishes both epochs in under a second.
    first = example(*common, "--checkpoint-every", "1", "--step-ms", "40", socket=tmp_path / "a.sock")
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline and first.poll() is None and not ckpt.exists():
        time.sleep(0.01)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=LIMIT)
    if first.returncode == 0:
        # It finished first on a fast machine: nothing was cut short.
        raise AssertionError(f"the first run ended before it was interrupted:\n{out}")
    saved = torch.load(ckpt, map_location="cpu")
    done = saved["data"]["sample"]
    assert saved["epoch"] == saved["data"]["epoch"] == 0, saved["data"]
    assert 0 < done < IMAGES, saved["data"]

    second = example(*common, "--resume", str(ckpt), socket=tmp_path / "b.sock")
    out, _ = second.communicate(timeout=LIMIT)
    assert second.returncode == 0, out
    assert f"resumed from {ckpt} in epoch 0" in out, out
    # The rest of epoch 0, then all of epoch 1: every sample once.
    assert epochs_seen(out) == {0: IMAGES - done, 1: IMAGES}, out

    # Resumed from the checkpoint the finished run saved at its end:
    # nothing is left, said so, and it exits 0.
    third = example(*common, "--resume", str(ckpt), socket=tmp_path / "d.sock")
    out, _ = third.communicate(timeout=LIMIT)
    assert third.returncode == 0, out
    assert "nothing left to do" in out, out
    assert epochs_seen(out) == {}, out

    # The DataLoader variant counts the same samples (its last batch is
    # short as the shared loader's is, not dropped).
    base = example("--data", str(data), "--epochs", "1", "--loader", "dataloader", socket=tmp_path / "c.sock")
    out, _ = base.communicate(timeout=LIMIT)
    assert base.returncode == 0, out
    assert epochs_seen(out) == {0: IMAGES}, out
