"""Fixtures: a real broker process per test, real consumer processes.

The broker binary is the one `batchcast.executable()` finds: `$BATCHCAST_BIN`,
else the binary the installed wheel carries (scripts/test builds the wheel
with the workspace's debug broker), else `batchcast` on PATH.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT = 60.0

# A developer's shell must not change what the tests do (BATCHCAST_JOIN,
# BATCHCAST_MAILBOX=0 are read by every consumer): the tests set the
# BATCHCAST_* variables they mean. BATCHCAST_BIN picks the broker only.
# BATCHCAST_TORCH=0 (scripts/setup's) is read first: see pytest_configure.
_WITHOUT_TORCH = os.environ.get("BATCHCAST_TORCH") == "0"
for _k in [k for k in os.environ if k.startswith("BATCHCAST_") and k != "BATCHCAST_BIN"]:
    del os.environ[_k]


def broker_bin() -> str:
    import batchcast

    exe = batchcast.executable(required=False)
    if exe is None:
        pytest.fail("no broker binary: install the wheel (scripts/test does) or set BATCHCAST_BIN")
    return exe


def synthetic(
    name: str = "train",
    batch: int = 8,
    length: int = 100,
    epochs: Optional[int] = 2,
    slots: int = 4,
    min_consumers: int = 1,
    fill: str = "full",
    fields: str = '{ name = "image", dtype = "u8", shape = [3, 4, 4] }, { name = "label", dtype = "i64", shape = [] }',
    extra: str = "",
) -> str:
    ep = f"epochs = {epochs}" if epochs is not None else ""
    return f"""
[[stream]]
name = "{name}"
batch_size = {batch}
{ep}
slots = {slots}
min_consumers = {min_consumers}
drop_last = false
workers = 1
{extra}
[stream.synthetic]
len = {length}
fill = "{fill}"
fields = [{fields}]
"""


class Broker:
    def __init__(
        self,
        tmp: Path,
        config: Optional[str],
        env: Optional[Dict[str, str]] = None,
        name: str = "broker",
        args: Sequence[str] = (),
    ) -> None:
        """`env`: variables added to the broker's environment; `name`: its
        files' names in `tmp` (several brokers in one test); `args`: more
        arguments to `batchcast serve`."""
        self.dir = tmp
        self.socket = str(tmp / ("b.sock" if name == "broker" else f"{name}.sock"))
        self.log = tmp / f"{name}.log"
        args = [broker_bin(), "serve", "--socket", self.socket, *args]
        if config is not None:
            cfg = tmp / f"{name}.toml"
            cfg.write_text(config)
            args += ["--config", str(cfg)]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"),
            env={**os.environ, **(env or {})},
        )
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"broker exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.stats_or_none() is not None:
                return
            if time.monotonic() - t0 > 30:
                pytest.fail("broker did not answer within 30 s")
            time.sleep(0.02)

    def stats_or_none(self) -> Optional[Dict]:
        r = subprocess.run(
            [broker_bin(), "stats", "--json", "--socket", self.socket],
            capture_output=True,
            text=True,
        )
        return json.loads(r.stdout) if r.returncode == 0 else None

    def stats(self) -> Dict:
        s = self.stats_or_none()
        assert s is not None, "broker stats failed"
        return s

    def stream(self, name: str) -> Dict:
        return next(s for s in self.stats()["streams"] if s["name"] == name)

    def wait_for(self, what: str, pred) -> Dict:
        t0 = time.monotonic()
        while True:
            s = self.stats()
            if pred(s):
                return s
            if time.monotonic() - t0 > LIMIT:
                pytest.fail(f"timed out waiting for {what}; last stats: {s}")
            time.sleep(0.02)

    def rust_consumer(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [broker_bin(), "consume", "--json", "--socket", self.socket, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def report(proc: subprocess.Popen) -> Dict:
    """The JSON report of a `batchcast consume` process."""
    out, _ = proc.communicate(timeout=LIMIT)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert lines, f"consumer exited with {proc.returncode} and no report: {out}"
    return json.loads(lines[-1])


# A child inherits an ignored SIGINT (a suite started as a background job
# runs with SIGINT ignored), and Python then never raises KeyboardInterrupt:
# children start as an interactive Python would, whatever the parent.
_INTERRUPTIBLE = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def python_child(code: str, *args: str, inherit_ignored_sigint: bool = False) -> subprocess.Popen:
    """A separate Python process running `code` with the same batchcast;
    Ctrl-C (SIGINT) raises KeyboardInterrupt in it. `inherit_ignored_sigint`
    starts it as a background job's child: with SIGINT ignored."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherit_ignored_sigint else None
    return subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTIBLE + code, *args],
        preexec_fn=ignore,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


@pytest.fixture
def start_broker(tmp_path: Path):
    started: List[Broker] = []

    def start(
        config: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        name: str = "broker",
        args: Sequence[str] = (),
    ) -> Broker:
        b = Broker(tmp_path, config, env, name, args)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


def small_image_folder(root: Path, images: int, seed: int) -> None:
    """An ImageFolder of `images` small random JPEGs in 3 classes
    (`class{i % 3}/img{i:03}.jpg`)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(images):
        d = root / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(d / f"img{i:03}.jpg", quality=90)


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_torch = pytest.mark.skipif(not has_torch(), reason="PyTorch is not installed in this environment")


def pytest_configure(config: pytest.Config) -> None:
    """Under CI=true the tests that need torch run: a missing torch stops the
    run naming why, instead of turning them into skips nobody reads.
    BATCHCAST_TORCH=0, said explicitly, runs without them."""
    if os.environ.get("CI") == "true" and not _WITHOUT_TORCH and not has_torch():
        raise pytest.UsageError(
            "CI=true runs the tests that need torch, and torch is not importable here: "
            "scripts/setup installs it (it needs 12 GB free); BATCHCAST_TORCH=0 runs without them"
        )
