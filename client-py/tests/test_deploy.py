"""The deployment recipes: deploy/slurm run for real on one machine with a
stand-in `srun` (two simulated nodes, faked SLURM_* variables, a broker
process per node), and deploy/k8s validated against Kubernetes' schemas.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path

import pytest

from conftest import LIMIT, REPO, broker_bin, small_image_folder

SLURM = REPO / "deploy" / "slurm"
IMAGES, EPOCHS, BATCH, NODES, TASKS = 48, 2, 4, 2, 2

# Stands in for Slurm's srun on one machine: runs the command once per task
# of --nodes x --ntasks-per-node (default: the job's), with the variables
# srun gives a task, and a TMPDIR per simulated node (as a node-local
# directory). SIGTERM goes on to the tasks, as srun passes it on.
FAKE_SRUN = r"""#!PYTHON
import os, signal, subprocess, sys
args = sys.argv[1:]
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
while args and args[0].startswith("--"):
    opt = args.pop(0)
    key, _, value = opt[2:].partition("=")
    if key == "nodes":
        nodes = int(value)
    elif key == "ntasks-per-node":
        per_node = int(value)
    elif key not in ("overlap", "ntasks", "cpus-per-task", "kill-on-bad-exit"):
        sys.exit(f"fake srun: unknown option {opt}")
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
tasks = []
for node in range(nodes):
    tmp = os.path.join(os.environ["FAKE_SLURM_ROOT"], f"node{node}")
    os.makedirs(tmp, exist_ok=True)
    for local in range(per_node):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_NNODES=str(nodes), SLURM_LOCALID=str(local),
                   SLURM_PROCID=str(node * per_node + local), SLURM_NTASKS=str(nodes * per_node),
                   SLURM_NTASKS_PER_NODE=str(per_node), TMPDIR=tmp)
        tasks.append(subprocess.Popen(args, env=env))
def forward(sig, _frame):
    for t in tasks:
        t.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
codes = [t.wait() for t in tasks]
sys.exit(max(codes, key=abs) if any(codes) else 0)
"""

TASK = r"""
import json, os, sys
import batchcast
# The seat comes from srun's SLURM_LOCALID / SLURM_NTASKS_PER_NODE, the
# socket from the job script's BATCHCAST_SOCKET.
c = batchcast.Consumer("train", group="trial", output="numpy", connect_timeout=60)
epochs = {}
while not c.ended:
    for b in c:
        epochs.setdefault(b.epoch, []).append(b["index"].tolist())
out = {"node": int(os.environ["SLURM_NODEID"]), "proc": int(os.environ["SLURM_PROCID"]),
       "socket": os.environ["BATCHCAST_SOCKET"], "epochs": epochs}
with open(os.path.join(sys.argv[1], f"task{os.environ['SLURM_PROCID']}.json"), "w") as f:
    json.dump(out, f)
"""


CONFIG = """
[[stream]]
name = "train"
batch_size = {batch}
epochs = {epochs}
slots = 8
min_consumers = {tasks}
workers = 1
seed = 5
rank = "slurm"          # SLURM_NODEID of the broker's step
world_size = "slurm"    # SLURM_NNODES
[stream.image_folder]
root = "{root}"
[stream.transform]
resize = 16
center_crop = 16
dtype = "u8"
"""


@pytest.fixture
def nodes():
    """The fake nodes' local folders, under a short path: a socket path
    under pytest's tmp_path (which grows with its run counter) can pass
    the 108 bytes a Unix socket allows, and the job refuses it."""
    d = Path(tempfile.mkdtemp(prefix="bc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _slurm_env(tmp: Path, nodes: Path) -> dict:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN.replace("#!PYTHON", f"#!{sys.executable}"))
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BATCHCAST_"))}
    env.update(
        PATH=f"{bindir}:{os.path.dirname(sys.executable)}:{env['PATH']}",
        BATCHCAST_BIN=broker_bin(),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES=str(NODES),
        SLURM_NNODES=str(NODES),
        SLURM_NTASKS_PER_NODE=str(TASKS),
        SLURM_SUBMIT_DIR=str(REPO),
        FAKE_SLURM_ROOT=str(nodes),
        FAKE_SRUN_LOG=str(tmp / "srun.log"),
    )
    return env


def test_the_sbatch_script_runs_a_broker_per_node_and_the_jobs_tasks(tmp_path, nodes):
    root = tmp_path / "images"
    small_image_folder(root, IMAGES, seed=11)
    config = tmp_path / "broker.toml"
    config.write_text(CONFIG.format(batch=BATCH, epochs=EPOCHS, tasks=TASKS, root=root))
    task = tmp_path / "task.py"
    task.write_text(TASK)
    out = tmp_path / "out"
    out.mkdir()
    env = _slurm_env(tmp_path, nodes)
    r = subprocess.run(
        ["bash", str(SLURM / "batchcast.sbatch"), str(config), sys.executable, str(task), str(out)],
        env=env, capture_output=True, text=True, timeout=4 * LIMIT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    reports = [json.loads((out / f"task{p}.json").read_text()) for p in range(NODES * TASKS)]
    # Each node's tasks read their node's broker: one socket per node, node-local.
    for node in range(NODES):
        sockets = {t["socket"] for t in reports if t["node"] == node}
        assert sockets == {str(nodes / f"node{node}" / "batchcast-4242" / "batchcast.sock")}, sockets
        # The broker stopped with the job and removed its socket.
        assert not os.path.exists(sockets.pop())
    for epoch in range(EPOCHS):
        per_node = [
            sorted(i for t in reports if t["node"] == node for batch in t["epochs"][str(epoch)] for i in batch)
            for node in range(NODES)
        ]
        # Each node's broker made only its share (rank = "slurm"), its two
        # tasks a group splitting that share: each image once in the job.
        assert all(len(p) == IMAGES // NODES for p in per_node)
        assert sorted(per_node[0] + per_node[1]) == list(range(IMAGES)), f"epoch {epoch}"
        counts = {len(t["epochs"][str(epoch)]) for t in reports}
        assert counts == {IMAGES // NODES // TASKS // BATCH}, "every task as many batches"
    launches = (tmp_path / "srun.log").read_text().splitlines()
    assert launches[0].startswith(f"--overlap --nodes={NODES} --ntasks-per-node=1"), launches[0]
    assert not any(p.exists() for p in nodes.glob("node*/batchcast-4242/batchcast.sock"))


@pytest.mark.parametrize(
    "change, says",
    [
        ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
        ({"SLURM_JOB_NUM_NODES": "two", "SLURM_NNODES": None}, "not a node count"),
        ({"BATCHCAST_RUN_DIR": "relative/dir"}, "not an absolute path"),
        ({"BATCHCAST_BIN": None, "PATH": "/usr/bin:/bin"}, "no batchcast binary"),
    ],
)
def test_the_slurm_functions_refuse_a_bad_environment_naming_it(tmp_path, nodes, change, says):
    env = _slurm_env(tmp_path, nodes)
    for k, v in change.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    r = subprocess.run(
        ["bash", "-c", f'source "{SLURM / "batchcast-slurm.sh"}" && batchcast_env'],
        env=env, capture_output=True, text=True, timeout=LIMIT,
    )
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr)


def test_a_broker_that_cannot_start_fails_the_job_naming_why(tmp_path, nodes):
    config = tmp_path / "broker.toml"
    config.write_text("[[stream]]\nname = 'train'\nbatch_size = 0\n")
    r = subprocess.run(
        ["bash", str(SLURM / "batchcast.sbatch"), str(config), "true"],
        env=_slurm_env(tmp_path, nodes), capture_output=True, text=True, timeout=4 * LIMIT,
    )
    assert r.returncode != 0
    assert "broker step exited" in r.stderr, r.stderr


def test_a_missing_config_or_a_too_long_node_local_socket_path_is_refused(tmp_path, nodes):
    env = _slurm_env(tmp_path, nodes)
    r = subprocess.run(
        ["bash", str(SLURM / "batchcast.sbatch"), str(tmp_path / "none.toml"), "true"],
        env=env, capture_output=True, text=True, timeout=LIMIT,
    )
    assert r.returncode == 2 and "none.toml' is not a file" in r.stderr, r.stderr
    config = tmp_path / "broker.toml"
    config.write_text(CONFIG.format(batch=BATCH, epochs=EPOCHS, tasks=TASKS, root=tmp_path))
    env["BATCHCAST_RUN_DIR"] = "/" + "d" * 120
    r = subprocess.run(
        ["bash", str(SLURM / "batchcast.sbatch"), str(config), "true"],
        env=env, capture_output=True, text=True, timeout=LIMIT,
    )
    assert r.returncode == 2 and "too long for a Unix socket" in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_a_socket_directory_another_user_made_is_refused(tmp_path, nodes):
    config = tmp_path / "broker.toml"
    config.write_text(CONFIG.format(batch=BATCH, epochs=EPOCHS, tasks=TASKS, root=tmp_path))
    planted = nodes / "node1" / "batchcast-4242"
    planted.mkdir(parents=True)
    os.chown(planted, 65534, 65534)  # nobody's, on node 1's "shared /tmp"
    r = subprocess.run(
        ["bash", str(SLURM / "batchcast.sbatch"), str(config), "true"],
        env=_slurm_env(tmp_path, nodes), capture_output=True, text=True, timeout=4 * LIMIT,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{planted} on " in r.stderr and "is not a directory of yours" in r.stderr, r.stderr
    assert not (planted / "batchcast.sock").exists()


def test_the_kubernetes_manifests_pass_schema_validation(tmp_path):
    validate = shutil.which("kubernetes-validate", path=os.path.dirname(sys.executable))
    if validate is None:
        pytest.skip("kubernetes-validate is not installed: bash scripts/setup installs it into .venv")
    manifests = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
    assert manifests, "deploy/k8s has no manifests"
    r = subprocess.run([validate, "--strict", *map(str, manifests)], capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.stdout + r.stderr).count(" passed ") >= 3, r.stdout + r.stderr  # 2 in the DaemonSet file, 1 Job
    # The validator does refuse a wrong manifest (a misspelt field).
    broken = tmp_path / "broken.yaml"
    broken.write_text((REPO / "deploy" / "k8s" / "broker-daemonset.yaml").read_text().replace("hostPath:", "hostPth:", 1))
    r = subprocess.run([validate, "--strict", str(broken)], capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode != 0, r.stdout + r.stderr


def _manifests():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (scripts/setup)")
    docs = []
    for f in sorted((REPO / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _daemonset():
    docs = _manifests()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["broker.toml"]
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    broker = next(c for c in pod["containers"] if c["name"] == "broker")
    return config, pod, broker


def _mib(quantity: str) -> int:
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    for unit, mib in units.items():
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * mib
    raise AssertionError(f"a memory quantity in Mi/Gi/Ti: {quantity}")


def test_the_daemonsets_broker_config_and_probes_are_what_the_broker_serves(start_broker, tmp_path):
    """The ConfigMap's config starts, with the container's own arguments
    (the metrics address moved to a free local port), and the liveness and
    readiness probes' paths answer 200 on the port they name."""
    config, _, broker_c = _daemonset()
    assert 'root = "/data/imagenet/train"' in config
    root = tmp_path / "images"
    small_image_folder(root, IMAGES, seed=11)
    args = broker_c["args"]
    assert args[0] == "serve" and args[args.index("--metrics") + 1] == "0.0.0.0:9464", args
    ports = {p["name"]: p["containerPort"] for p in broker_c["ports"]}
    assert ports[broker_c["livenessProbe"]["httpGet"]["port"]] == 9464
    assert ports[broker_c["readinessProbe"]["httpGet"]["port"]] == 9464
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = start_broker(
        config.replace("/data/imagenet/train", str(root)),
        name="k8s",
        args=["--metrics", f"127.0.0.1:{port}"],
    )
    stream = broker.stream("train")
    assert stream["source"] is not None and stream["failed"] is None, stream
    for probe in ("livenessProbe", "readinessProbe"):
        path = broker_c[probe]["httpGet"]["path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=broker_c[probe]["timeoutSeconds"]) as r:
            assert r.status == 200, (probe, path, r.status)


def test_the_manifests_need_no_shared_memory_and_size_the_broker_as_they_say():
    """No pod asks for /dev/shm or the host's IPC namespace (batches are
    file descriptors over the socket), and the broker's memory limit holds
    what its comment counts: memory_mib, 64 MiB per pipeline worker, the
    encoded cache (cache_mib) and slack."""
    docs = _manifests()
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("DaemonSet", "Job")]
    assert len(pods) == 2
    for pod in pods:
        assert not pod.get("hostIPC") and not pod.get("hostPID"), pod
        for v in pod.get("volumes", []):
            assert v.get("emptyDir", {}).get("medium") != "Memory", v
        for c in pod["containers"]:
            assert all(m["mountPath"] != "/dev/shm" for m in c.get("volumeMounts", [])), c
    config, _, broker_c = _daemonset()
    cfg = tomllib.loads(config)
    workers = sum(s.get("workers", 1) for s in cfg["stream"])
    need = cfg["broker"]["memory_mib"] + 64 * workers + sum(s.get("cache_mib", 0) for s in cfg["stream"])
    limit = _mib(broker_c["resources"]["limits"]["memory"])
    assert _mib(broker_c["resources"]["requests"]["memory"]) == limit
    assert need < limit, (need, limit)


def test_batches_reach_a_trainer_where_dev_shm_is_read_only(tmp_path):
    """The DaemonSet comment's claim, run: in a mount namespace whose
    /dev/shm is an empty read-only tmpfs (a pod without a shared /dev/shm)
    the broker serves the ConfigMap's stream and a Python trainer reads a
    whole epoch from it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")
    config, _, _ = _daemonset()
    root = tmp_path / "images"
    small_image_folder(root, IMAGES, seed=11)
    cfg = tmp_path / "broker.toml"
    cfg.write_text(config.replace("/data/imagenet/train", str(root)).replace("batch_size = 256", "batch_size = 16\nepochs = 1"))
    sock = tmp_path / "b.sock"
    trainer = f"""
import os, subprocess, sys, time
import batchcast
try:
    open("/dev/shm/probe", "w")
    sys.exit("/dev/shm is writable")
except OSError:
    pass
assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
broker = subprocess.Popen([{broker_bin()!r}, "serve", "--config", {str(cfg)!r}, "--socket", {str(sock)!r}], stderr=subprocess.DEVNULL)
try:
    c = batchcast.Consumer("train", socket={str(sock)!r}, output="numpy", connect_timeout=30)
    n = sum(len(b["label"]) for b in c)
    print("samples", n, "shm", os.listdir("/dev/shm"), flush=True)
finally:
    broker.terminate()
    broker.wait(10)
"""
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro,size=4k none /dev/shm && exec "$0" -c "$1"', sys.executable, trainer],
        capture_output=True, text=True, timeout=LIMIT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"samples {IMAGES} shm []" in r.stdout, r.stdout + r.stderr
