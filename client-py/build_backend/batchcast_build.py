"""PEP 517 build backend of the `batchcast` package: maturin's, plus the broker.

maturin builds the Python client's native module (`batchcast._native`). This
backend first builds the broker (`cargo build --release -p batchcast-cli`)
and stages its binary where maturin's `data` setting puts it into the wheel
(`batchcast-X.data/scripts/batchcast`), so `pip install` puts the
`batchcast` command on PATH. `BATCHCAST_WHEEL_BROKER=/path/to/batchcast`
stages a binary built elsewhere instead (scripts/build-wheels does, for
manylinux builds), and `BATCHCAST_STRIP` names the strip program for it.

The sdist is the whole source tree (the Cargo workspace, both clients and
the broker), so a machine with no matching wheel builds everything from it
(with Rust, cmake and nasm installed).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import maturin
from maturin import (  # noqa: F401  (re-exported hooks)
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
)

ROOT = Path(__file__).resolve().parents[2]
# Where pyproject.toml's `[tool.maturin] data` points.
SCRIPTS = ROOT / "target" / "wheel-data" / "scripts"
# Never in an sdist: build outputs, environments, caches.
SKIP = {".git", "target", ".venv", "__pycache__", "batchcast-runs", "dist", ".pytest_cache"}


def version() -> str:
    """The workspace's version (Cargo.toml), which every crate and the wheel share."""
    text = (ROOT / "Cargo.toml").read_text()
    m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not m:
        raise RuntimeError(f"no [workspace.package] version in {ROOT / 'Cargo.toml'}")
    return m.group(1)


def stage_broker() -> Path:
    """Puts the broker binary where the wheel takes it from; returns its path."""
    prebuilt = os.environ.get("BATCHCAST_WHEEL_BROKER")
    if prebuilt:
        src = Path(prebuilt)
        if not src.is_file():
            raise RuntimeError(f"BATCHCAST_WHEEL_BROKER={prebuilt} is not a file")
    else:
        cargo = os.environ.get("CARGO", "cargo")
        if shutil.which(cargo) is None:
            raise RuntimeError(
                "building batchcast from source needs Rust (cargo), cmake and nasm: "
                "install Rust from https://rustup.rs and cmake/nasm from your distribution, "
                "or install a prebuilt wheel"
            )
        cmd = [cargo, "build", "--release", "--locked", "-p", "batchcast-cli"]
        subprocess.run(cmd, cwd=ROOT, check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        src = target / "release" / "batchcast"
    SCRIPTS.mkdir(parents=True, exist_ok=True)
    dst = SCRIPTS / "batchcast"
    if dst.exists():
        dst.unlink()
    # The host's strip; BATCHCAST_STRIP names another (a cross build's).
    strip = shutil.which(os.environ.get("BATCHCAST_STRIP", "strip"))
    if strip:
        subprocess.run([strip, "-o", str(dst), str(src)], check=True)
    else:
        shutil.copyfile(src, dst)
    dst.chmod(dst.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return dst


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    # maturin wants its `data` folder to exist even for the metadata.
    SCRIPTS.mkdir(parents=True, exist_ok=True)
    return maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    stage_broker()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_dev_wheel(module: Path, broker: Path, wheel_directory: Path) -> Path:
    """The test suite's wheel, put together from what `cargo test
    --workspace` already built (the client's module and the debug broker,
    both stripped) instead of building them again: the same files where
    maturin puts them, its metadata (`prepare_metadata_for_build_wheel`),
    a `linux_x86_64` tag (installable on this machine, not for release)."""
    name = f"batchcast-{version()}"
    wheel = Path(wheel_directory) / f"{name}-cp39-abi3-linux_{os.uname().machine}.whl"
    strip = shutil.which("strip")
    files: list[tuple[str, bytes, int]] = []
    for f in sorted((ROOT / "client-py" / "python" / "batchcast").iterdir()):
        if f.is_file() and f.suffix in (".py", ".pyi", ".typed"):
            files.append((f"batchcast/{f.name}", f.read_bytes(), 0o644))
    with tempfile.TemporaryDirectory() as tmp:
        for src, dst, mode in ((module, "batchcast/_native.abi3.so", 0o755), (broker, f"{name}.data/scripts/batchcast", 0o755)):
            if not Path(src).is_file():
                raise RuntimeError(f"{src} is not built: run `cargo test --workspace --no-run` first")
            out = Path(tmp) / Path(dst).name
            if strip:
                subprocess.run([strip, "-o", str(out), str(src)], check=True)
            else:
                shutil.copyfile(src, out)
            files.append((dst, out.read_bytes(), mode))
        info = prepare_metadata_for_build_wheel(tmp, None)
        metadata = (Path(tmp) / info / "METADATA").read_bytes()
    tag = f"cp39-abi3-linux_{os.uname().machine}"
    files.append((f"{name}.dist-info/METADATA", metadata, 0o644))
    files.append((f"{name}.dist-info/WHEEL", f"Wheel-Version: 1.0\nGenerator: batchcast_build (dev)\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(), 0o644))
    record = []
    for path, data, _ in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}.dist-info/RECORD,,")
    files.append((f"{name}.dist-info/RECORD", ("\n".join(record) + "\n").encode(), 0o644))
    Path(wheel_directory).mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for path, data, mode in files:
            entry = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (0o100000 | mode) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data, compresslevel=1)
    return wheel


def sdist_files() -> list[Path]:
    """The source tree's files: git's list in a checkout, else a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        return sorted(ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
            files += [Path(dirpath) / f for f in filenames if f != "PKG-INFO"]
        return sorted(files)


def build_sdist(sdist_directory, config_settings=None):
    name = f"batchcast-{version()}"
    with tempfile.TemporaryDirectory() as meta_dir:
        info = prepare_metadata_for_build_wheel(meta_dir, config_settings)
        pkg_info = (Path(meta_dir) / info / "METADATA").read_bytes()
    path = Path(sdist_directory) / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for f in sdist_files():
            tar.add(f, arcname=f"{name}/{f.relative_to(ROOT)}", recursive=False)
        entry = tarfile.TarInfo(f"{name}/PKG-INFO")
        entry.size = len(pkg_info)
        entry.mode = 0o644
        tar.addfile(entry, io.BytesIO(pkg_info))
    return path.name
