"""batchcast on Ray: a local cluster of two simulated nodes
(`ray.cluster_utils.Cluster`, a raylet each, one machine).

* An ASHA sweep (examples/ray_tune_sweep.py, numpy trainables): one broker
  per node by its stats, every epoch of every trial complete, trials ASHA
  stopped early leave nothing subscribed, the brokers stop with the cluster.
* A Ray Data dataset feeding one node's stream (`batchcast.ray.feed`): that
  node's trainers read every row of every epoch once, with the bytes the
  dataset made; `batchcast.ray.shutdown()` stops every broker.
* A configured image stream made by its own pipeline on the other node
  (`batchcast.ray.feed_stream`): the host's trainers get the epochs of a
  broker serving the config itself, digest for digest.

Needs Ray (`scripts/setup` installs it into .venv); skipped, saying so,
where it is absent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, report as report_of, small_image_folder

try:
    import ray  # noqa: F401

    HAS_RAY = True
except ImportError:
    HAS_RAY = False

pytestmark = pytest.mark.skipif(
    not HAS_RAY, reason="Ray is not installed: bash scripts/setup installs it into .venv (about 40 s, 650 MB)"
)


def gone(pid: int, within_s: float = 20.0) -> bool:
    """Whether process `pid` has exited (or is a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def answers(path: str) -> bool:
    """Whether anything listens on the Unix socket at `path`."""
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def run(args, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "BATCHCAST_RAY_DIR": str(tmp_path / "r"), "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"{args[1]} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def test_an_asha_sweep_on_two_nodes_gets_one_broker_per_node(tmp_path):
    out = tmp_path / "sweep.json"
    epochs = 4
    run(
        [
            sys.executable,
            str(REPO / "examples" / "ray_tune_sweep.py"),
            "--simulate-nodes", "2",
            "--trials", "8",
            "--epochs", str(epochs),
            "--keep-brokers",  # they must stop with the cluster
            "--json", str(out),
        ],
        tmp_path,
        timeout=280,  # under pytest-timeout's 300 s
    )
    report = json.loads(out.read_text())
    trials, brokers = report["trials"], report["brokers"]
    assert len(trials) == 8

    # One broker per node: two brokers, on the two nodes trials ran on.
    trial_nodes = {e["node"] for t in trials for e in t["epochs"]}
    assert set(brokers) == trial_nodes and len(brokers) == 2, (set(brokers), trial_nodes)
    assert len({b["pid"] for b in brokers.values()}) == 2
    for node, b in brokers.items():
        stream = next(s for s in b["stats"]["streams"] if s["name"] == "train")
        served = {c["name"] for c in stream["past_consumers"]}
        # Each trial subscribed to the broker of the node it ran on, once.
        here = {f"trial-{t['trial']}" for t in trials if t["epochs"][0]["node"] == node}
        assert served == here, (node, served, here)
        # Trials that ended, ASHA's early stops included, left nothing behind.
        assert stream["consumers"] == [], stream["consumers"]
        assert b["stats"]["connections"]["held"] == 1  # the stats request itself
        assert b["stats"]["memory"]["replay_bytes"] == 0

    # Every epoch of every trial complete: each of the stream's samples once
    # (distinct 64-bit keys), whatever the trial's batch size and start.
    for t in trials:
        for e in t["epochs"]:
            assert e["samples"] == 2048 and e["distinct"] == 2048, (t["trial"], t["config"], e)
    lengths = sorted(len(t["epochs"]) for t in trials)
    assert lengths[-1] == epochs and lengths[0] < epochs, f"ASHA stopped no trial early: {lengths}"
    assert len({t["config"]["batch_size"] for t in trials}) > 1

    # The cluster is gone: so are its brokers (Ray kills a worker's
    # children with it, SIGKILL at a cluster's stop). A socket file left
    # behind answers nobody, and the next broker replaces it.
    for b in brokers.values():
        assert gone(b["pid"]), f"broker {b['pid']} outlived the cluster"
        assert not answers(b["socket"]), f"something still answers on {b['socket']}"


FEED = r"""
import json, os, subprocess, sys, time
import numpy as np
import ray
from ray.cluster_utils import Cluster
import batchcast, batchcast.ray

ROWS, BATCH, EPOCHS, WIDTH = 600, 32, 2, 64

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
ray.init(address=cluster.address)
host = ray.get_runtime_context().get_node_id()  # the driver's: the head node
other = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] != host)
batchcast.ray.init()  # no configured stream: feed() registers one

def make(batch):
    ids = batch["id"].astype(np.int64)
    x = ((ids[:, None] * 7 + np.arange(WIDTH)[None, :]) % 251).astype(np.uint8)
    return {"key": ids, "x": x}

@ray.remote(num_cpus=0)
def trainer(stream, name):
    c = batchcast.Consumer(stream=stream, output="numpy", name=name, connect_timeout=60)
    epochs, wrong = [], 0
    for _ in range(EPOCHS):
        keys = []
        for key, x in c:
            expect = ((key[:, None] * 7 + np.arange(WIDTH)[None, :]) % 251).astype(np.uint8)
            wrong += int((x != expect).any(axis=1).sum())
            keys.extend(key.tolist())
        epochs.append(keys)
    return {"node": ray.get_runtime_context().get_node_id(), "epochs": epochs, "wrong": wrong,
            "socket": c._args["socket"]}

@ray.remote(num_cpus=0)
def consume(stream, name):
    # The test consumer's per-epoch digests: what a broker serving the
    # config itself gives is compared with them.
    from batchcast._exe import executable
    args = [executable(), "consume", "--json", "--digest", "--socket", batchcast.ray.socket(),
            "--stream", stream, "--name", name, "--connect-timeout", "120"]
    r = subprocess.run(args, capture_output=True, text=True)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    report["stderr"] = r.stderr[-2000:]
    report["node"] = ray.get_runtime_context().get_node_id()
    return report

# One cluster, one stream per placement of Ray Data's executor (a cluster
# takes about 15 s to start): "here", on the fed node; "elsewhere", on the
# other node (a streaming split held there), the fed node only iterating
# and copying; then "native": a configured stream made by its own pipeline
# on the other node (batchcast make) and fed to the host.
runs = {}
try:
    pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=host, soft=False)
    for executor in sys.argv[1:]:
        if executor == "native":
            fed = batchcast.ray.feed_stream(os.environ["NATIVE_CONFIG"], "photos", node_id=host, min_consumers=2)
            readers = ray.get([consume.options(scheduling_strategy=pin).remote("photos", f"n{i}") for i in range(2)])
            runs[executor] = {"readers": readers, "figures": ray.get(fed), "other": other}
            continue
        ds = ray.data.range(ROWS, override_num_blocks=8).map_batches(make, batch_size=BATCH)
        stream = f"rows-{executor}"
        fed = batchcast.ray.feed(ds, stream, batch_size=BATCH, epochs=EPOCHS, node_id=host, rows=ROWS, min_consumers=2,
                                 executor_node=other if executor == "elsewhere" else None)
        readers = ray.get([trainer.options(scheduling_strategy=pin).remote(stream, f"t{i}") for i in range(2)])
        runs[executor] = {"readers": readers, "figures": ray.get(fed)}
    brokers = batchcast.ray.brokers()
    mode = os.stat(os.path.dirname(brokers[host]["socket"])).st_mode & 0o777
    batchcast.ray.shutdown()
    left = batchcast.ray.brokers()
finally:
    ray.shutdown()
    cluster.shutdown()
print(json.dumps({"host": host, "runs": runs, "brokers": brokers, "dir_mode": mode, "left": left, "rows": ROWS}))
"""


NATIVE = """
[[stream]]
name = "photos"
batch_size = 8
epochs = 2
shuffle = true
seed = 19
drop_last = false
workers = 1
[stream.image_folder]
root = "{root}"
[stream.transform]
random_resized_crop = {{ size = 16 }}
horizontal_flip = 0.5
normalize = {{ mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }}
"""


def test_a_ray_data_dataset_or_a_streams_own_pipeline_feeds_one_nodes_trainers(tmp_path, start_broker, monkeypatch):
    """Ray Data's executor on either node; and a configured stream made on
    the other node by its own pipeline (`batchcast.ray.feed_stream`): the
    host's trainers read the same epochs, digest for digest, as from a
    broker serving the config itself."""
    images = 60  # 7 batches of 8 and a short one
    small_image_folder(tmp_path / "photos", images, seed=4)
    config = tmp_path / "photos.toml"
    config.write_text(NATIVE.format(root=tmp_path / "photos"))
    local = start_broker(config.read_text())
    reference = local.rust_consumer("--digest", "--stream", "photos")
    want = [e["digest"] for e in report_of(reference)["epochs"]]
    assert len(want) == 2 and len(set(want)) == 2, want
    script = tmp_path / "feed.py"
    script.write_text(FEED)
    monkeypatch.setenv("NATIVE_CONFIG", str(config))
    r = run([sys.executable, str(script), "here", "elsewhere", "native"], tmp_path, timeout=300)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    host, rows = report["host"], report["rows"]
    # Only the fed node got a broker: the dataset's work ran where Ray put
    # it, the hand-off on the trainers' node.
    assert list(report["brokers"]) == [host]
    assert report["dir_mode"] == 0o700
    native = report["runs"].pop("native")
    for reader in native["readers"]:
        assert reader["ok"] and reader["ended"], reader
        assert reader["node"] == host
        assert [e["digest"] for e in reader["epochs"]] == want, reader
        assert [e["samples"] for e in reader["epochs"]] == [images, images], reader
    figures = native["figures"]
    assert figures["epochs"] == 2 and figures["samples"] == 2 * images, figures
    # Every batch was made on the other node, none on the host.
    assert [m["node_id"] for m in figures["makers"]] == [native["other"]], figures
    assert figures["makers"][0]["samples"] == 2 * images, figures
    # An f32 stream normalised by a table: its pixels travelled as u8 (the
    # default wire) and the digests above are still the broker's.
    assert figures["widened"] is True, figures
    batches = figures["batches"]
    assert figures["wire_bytes"] == 16 * batches + 2 * images * (16 * 16 * 3 + 16), figures
    assert sorted(report["runs"]) == ["elsewhere", "here"]
    for executor, fed in report["runs"].items():
        for reader in fed["readers"]:
            assert reader["node"] == host, executor
            assert reader["socket"] == report["brokers"][host]["socket"], executor
            assert reader["wrong"] == 0, executor
            for keys in reader["epochs"]:
                assert sorted(keys) == list(range(rows)), executor
        assert fed["figures"]["epochs"] == 2 and fed["figures"]["samples"] == 2 * rows, executor
    # shutdown() stopped every broker.
    assert report["left"] == {}
    for b in report["brokers"].values():
        assert gone(b["pid"])
