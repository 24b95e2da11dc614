"""What the Python benchmark harnesses share: progress that shows in pipes,
where the repository and the release broker are, and the image stream they
measure (torchvision's RandomResizedCrop + horizontal flip + Normalize to
float32 NCHW, as the DataLoaders they compare with)."""

from __future__ import annotations

import builtins
import functools
import os
import subprocess
import time
from pathlib import Path

print = functools.partial(builtins.print, flush=True)  # noqa: A001 (progress in pipes)
REPO = Path(__file__).resolve().parents[1]
EXE = os.environ.get("BATCHCAST_BIN") or str(REPO / "target" / "release" / "batchcast")


def image_stream(name: str, root: Path, batch: int, size: int = 224, dtype: str = "f32", **keys: object) -> str:
    """A `[[stream]]` table reading the ImageFolder at `root`, augmented as
    torchvision's RandomResizedCrop(size) + RandomHorizontalFlip +
    Normalize (ImageNet's) to float32 (`dtype="u8"`: uint8 pixels, not
    normalised, as a trainer that normalises on its GPU takes them).
    `keys`: more keys of the stream (`epochs`, `slots`, `workers`,
    `min_consumers`, `seed`, ...), None ones left out; strings are quoted,
    other values written as they are."""
    lines = [f'name = "{name}"', f"batch_size = {batch}"]
    for key, value in keys.items():
        if value is None:
            continue
        text = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"{key} = {text}")
    body = "\n".join(lines)
    normalize = "" if dtype == "u8" else "normalize = { mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }\n"
    return f"""
[[stream]]
{body}

[stream.image_folder]
root = "{root}"

[stream.transform]
random_resized_crop = {{ size = {size} }}
horizontal_flip = 0.5
{normalize}dtype = "{dtype}"
"""


def serve(folder: Path, toml: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """The release broker serving `toml` (written to `folder`/b.toml) on
    `folder`/b.sock, its log in `folder`/broker.log; returns once its
    socket is there (exits naming the log's end if it fails)."""
    (folder / "b.toml").write_text(toml)
    sock = folder / "b.sock"
    broker = subprocess.Popen([EXE, "serve", "--config", str(folder / "b.toml"), "--socket", str(sock)],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(folder / "broker.log", "w"))
    for _ in range(600):
        if sock.exists():
            return broker, sock
        if broker.poll() is not None:
            raise SystemExit(f"broker failed: {(folder / 'broker.log').read_text()[-2000:]}")
        time.sleep(0.05)
    broker.kill()
    raise SystemExit(f"the broker made no socket in 30 s: {(folder / 'broker.log').read_text()[-2000:]}")


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has spent so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_stopped(pid: int, limit_s: float = 120) -> None:
    """Returns once process `pid` is stopped (SIGSTOP: state T in
    /proc/PID/stat); exits naming it after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.005)
    raise SystemExit(f"process {pid} never stopped")
