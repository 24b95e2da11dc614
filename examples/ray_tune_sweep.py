"""An ASHA sweep with Ray Tune over learning rate and batch size, every trial
fed by its node's batchcast broker.

    python examples/ray_tune_sweep.py                      # on ray.init()'s cluster
    python examples/ray_tune_sweep.py --simulate-nodes 2   # a local cluster of 2 nodes

What Ray does: places trials on nodes, starts and stops them (ASHA stops the
worst early, later trials start as slots free up). What batchcast does: one
broker per node (`batchcast.ray.init` on the driver; the first trial on a
node starts it), one pipeline per node for all its trials, each trial with
its own batch size joining at any time with complete epochs (`join="now"`).
The trainable's one batchcast line is `batchcast.Consumer(...)`.

The model is a numpy linear regression on a synthetic stream, so this runs
anywhere; a real trainable swaps in its model and an image stream's config.
`--json FILE` writes each trial's per-epoch figures and each broker's stats.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import BasicVariantGenerator

import batchcast
import batchcast.ray

SAMPLES = 2048
FEATURES = 16
CONFIG = f"""
[[stream]]
name = "train"
batch_size = 32
max_batch_size = 128    # the largest batch size a trial asks for
[stream.synthetic]
len = {SAMPLES}
fields = [
  {{ name = "key", dtype = "u64", shape = [] }},
  {{ name = "x", dtype = "u8", shape = [{FEATURES}] }},
]
"""


def trainable(config: Dict[str, Any]) -> None:
    """One trial: `config["epochs"]` epochs of linear regression; reports
    each epoch's loss and what it read (samples, distinct keys, its node)."""
    trial = tune.get_context().get_trial_id()
    node = ray.get_runtime_context().get_node_id()
    consumer = batchcast.Consumer(
        stream="train",
        batch_size=config["batch_size"],
        output="numpy",
        join="now",  # a trial starting mid-epoch still gets complete epochs
        name=f"trial-{trial}",
        connect_timeout=60,
    )
    truth = np.linspace(-1.0, 1.0, FEATURES)
    w = np.zeros(FEATURES)
    for epoch in range(config["epochs"]):
        seen: List[int] = []
        loss = 0.0
        for key, x in consumer:
            features = x.astype(np.float64) / 255.0
            target = features @ truth
            error = features @ w - target
            w -= config["lr"] * features.T @ error / len(error)
            loss += float(error @ error)
            seen.extend(key.tolist())
        tune.report(
            {
                "loss": loss / len(seen),
                "epoch": epoch,
                "samples": len(seen),
                "distinct": len(set(seen)),
                "node": node,
                "batch_size": config["batch_size"],
            }
        )


def sweep(trials: int, epochs: int, storage: str, seed: int) -> List[Dict[str, Any]]:
    """Runs the sweep on the cluster Ray is connected to; returns each
    trial's per-epoch reports."""
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        param_space={
            "lr": tune.loguniform(0.01, 2.0),
            "batch_size": tune.choice([16, 32, 64, 128]),
            "epochs": epochs,
        },
        tune_config=tune.TuneConfig(
            metric="loss",
            mode="min",
            num_samples=trials,
            search_alg=BasicVariantGenerator(random_state=seed),
            scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(storage_path=storage, verbose=0),
    )
    results = tuner.fit()
    out = []
    for result in results:
        if result.error:
            raise RuntimeError(f"trial failed: {result.error}")
        history = result.metrics_dataframe
        out.append(
            {
                "trial": result.metrics["trial_id"],
                "config": {k: result.config[k] for k in ("lr", "batch_size")},
                "epochs": history[["epoch", "samples", "distinct", "loss", "node"]].to_dict("records"),
            }
        )
    return out


def broker_stats(settle_s: float = 30.0) -> Dict[str, Any]:
    """Each node's broker and its `batchcast stats`, once no trial is
    subscribed any more (or after `settle_s`: trials Tune stopped have
    gone, or the stats say which have not)."""
    deadline = time.monotonic() + settle_s
    while True:
        out = {}
        for node, info in batchcast.ray.brokers().items():
            r = subprocess.run(
                [batchcast.executable(), "stats", "--json", "--socket", info["socket"]],
                capture_output=True,
                text=True,
                check=True,
            )
            out[node] = {**info, "stats": json.loads(r.stdout)}
        subscribed = sum(len(s["consumers"]) for b in out.values() for s in b["stats"]["streams"])
        if subscribed == 0 or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seeds the trials' learning rates and batch sizes")
    p.add_argument("--simulate-nodes", type=int, default=0, help="start a local cluster of this many nodes")
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--json", help="write trials and broker stats here")
    p.add_argument(
        "--keep-brokers",
        action="store_true",
        help="leave the brokers running (they stop with the cluster) instead of batchcast.ray.shutdown()",
    )
    a = p.parse_args()
    cluster = None
    if a.simulate_nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(a.simulate_nodes):
            cluster.add_node(num_cpus=a.cpus_per_node)
        ray.init(address=cluster.address)
    else:
        ray.init()
    batchcast.ray.init(CONFIG)
    try:
        with tempfile.TemporaryDirectory() as storage:
            trials = sweep(a.trials, a.epochs, storage, a.seed)
        brokers = broker_stats()
        for t in trials:
            print(
                f"trial {t['trial']}: lr {t['config']['lr']:.3f} batch {t['config']['batch_size']:>3}: "
                f"{len(t['epochs'])} epochs, loss {t['epochs'][-1]['loss']:.4f}"
            )
        for node, b in brokers.items():
            served = len(b["stats"]["streams"][0]["past_consumers"])
            print(f"node {node[:12]}: broker pid {b['pid']}, {served} trials served")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"trials": trials, "brokers": brokers}, f)
    finally:
        if not a.keep_brokers:
            batchcast.ray.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
