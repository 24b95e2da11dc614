"""torchrun across nodes, on one machine: two torchrun "nodes" (`--nnodes 2
--node-rank 0|1`, c10d rendezvous on 127.0.0.1, 2 processes each, gloo on
CPU), each node with its own broker whose share of the dataset comes from
its environment (`rank = "torchrun"`). Each rank reads its node's broker
as a member of one group (its seat from torchrun's LOCAL_RANK and
LOCAL_WORLD_SIZE) and takes part in an all-reduce every step, as DDP
does: unequal batch counts would hang it. Together the 4 ranks read each
image once per epoch, and each broker decodes only its node's share.

Needs torch (CPU is enough); skipped with a message where it is absent.
CI installs it (scripts/setup, when CI=true and the disk has room).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LIMIT, has_torch, small_image_folder

pytestmark = pytest.mark.skipif(
    not has_torch(),
    reason="torch is not installed: BATCHCAST_TORCH=1 bash scripts/setup installs it into .venv "
    "(about 90 s and 5.4 GB: PyPI's Linux torch brings its CUDA libraries)",
)

# 48 photographs-like images: 24 a node, 12 a rank, batches of 4 (3 a rank
# an epoch, no tail): every image once per epoch across the 4 ranks.
IMAGES = 48
EPOCHS = 2
BATCH = 4

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import batchcast

dist.init_process_group("gloo")
# The seat comes from torchrun's environment (LOCAL_RANK, LOCAL_WORLD_SIZE).
c = batchcast.Consumer("train", socket=os.environ["NODE_SOCKET"], group="trial", output="torch", connect_timeout=60)
epochs = {}
while not c.ended:
    for b in c:
        epochs.setdefault(b.epoch, []).append(b["index"].tolist())
        # A collective every step, as DDP's gradient all-reduce: a rank
        # with fewer batches would leave the others waiting here.
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
out = {"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"]), "epochs": epochs, "per_epoch": len(c)}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    """A port to host torchrun's rendezvous store on, free now and below
    Linux's ephemeral range (32768-60999): a port the kernel hands out
    (binding port 0) may be taken by an outgoing connection before
    torchrun binds it, and then neither node can host the store: both
    become its clients and wait out the rendezvous timeout."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32000 for torchrun's rendezvous")


def _config(root: Path) -> str:
    return f"""
[[stream]]
name = "train"
batch_size = {BATCH}
epochs = {EPOCHS}
slots = 8
min_consumers = 2
workers = 1
seed = 3
rank = "torchrun"
world_size = "torchrun"
drop_last = false

[stream.image_folder]
root = "{root}"

[stream.transform]
resize = 16
center_crop = 16
dtype = "u8"
"""


def test_two_torchrun_nodes_each_with_its_broker_read_each_image_once(start_broker, tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torch is installed without its torchrun command")
    root = tmp_path / "images"
    small_image_folder(root, IMAGES, seed=7)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    brokers, nodes = [], []
    for node in range(2):
        # What torchrun sets for its workers on that node, given to the
        # node's broker (by the job script, or a Slurm/Ray launcher).
        env = {"GROUP_RANK": str(node), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
        brokers.append(start_broker(_config(root), env=env, name=f"node{node}"))
    for node in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GROUP_", "LOCAL_", "RANK", "WORLD_"))}
        env.update(NODE_SOCKET=brokers[node].socket, OMP_NUM_THREADS="1")
        nodes.append(
            subprocess.Popen(
                [
                    torchrun,
                    "--nnodes=2",
                    f"--node-rank={node}",
                    "--nproc-per-node=2",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=batchcast-test",
                    str(script),
                    str(out),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    for p in nodes:
        try:
            log, _ = p.communicate(timeout=4 * LIMIT)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail("torchrun did not finish: a rank waits in a collective (unequal batch counts?)")
        assert p.returncode == 0, log
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    # Each broker served its node's share and decoded only it.
    for node, b in enumerate(brokers):
        s = b.stream("train")
        assert s["share"] == [node, 2, IMAGES // 2], s["share"]
        assert s["source"]["decoded"] == EPOCHS * IMAGES // 2, s["source"]
    for epoch in range(EPOCHS):
        counts = {len(r["epochs"][str(epoch)]) for r in reports}
        assert counts == {IMAGES // 4 // BATCH}, "every rank as many batches"
        seen = sorted(i for r in reports for batch in r["epochs"][str(epoch)] for i in batch)
        assert seen == list(range(IMAGES)), f"epoch {epoch}: each image once across the 4 ranks"
    assert {r["per_epoch"] for r in reports} == {IMAGES // 4 // BATCH}
    assert sorted(r["node"] for r in reports) == [0, 0, 1, 1]
