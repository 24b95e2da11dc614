"""The installed package: the broker binary it carries, versions reported
together, and a broker of another release refused with both named."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import batchcast


def test_the_wheel_carries_the_broker_and_versions_are_reported_together(monkeypatch):
    monkeypatch.delenv("BATCHCAST_BIN", raising=False)
    exe = batchcast.executable()
    assert Path(exe).is_file() and os.access(exe, os.X_OK)
    want = f"batchcast {batchcast.__version__} (protocol {batchcast.PROTOCOL_VERSION})"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == want
    # `python -m batchcast` runs the same binary.
    out = subprocess.run(
        [sys.executable, "-m", "batchcast", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == want


def test_a_bad_batchcast_bin_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "batchcast"
    monkeypatch.setenv("BATCHCAST_BIN", str(missing))
    with pytest.raises(batchcast.BrokerUnavailable, match=str(missing)):
        batchcast.executable()
    assert batchcast.executable(required=False) is None


def test_a_broker_of_another_release_is_refused_naming_both(tmp_path):
    """A listener answers with a newer release's preamble (no other release
    can run here); the client refuses it and says what to upgrade."""
    path = str(tmp_path / "newer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    seen = {}

    def fake_broker() -> None:
        conn, _ = server.accept()
        with conn:
            seen["preamble"] = conn.recv(8)
            conn.sendall(b"BCST" + (batchcast.PROTOCOL_VERSION + 1).to_bytes(2, "little") + bytes([major, minor + 1]))
            conn.recv(64)  # open until the client gives up

    major, minor = (int(x) for x in batchcast.__version__.split(".")[:2])
    t = threading.Thread(target=fake_broker, daemon=True)
    t.start()
    with pytest.raises(batchcast.VersionMismatch) as e:
        batchcast.Consumer(stream="train", socket=path, output="numpy")
    t.join(10)
    assert seen["preamble"] == b"BCST" + batchcast.PROTOCOL_VERSION.to_bytes(2, "little") + bytes([major, minor])
    msg = str(e.value)
    assert f"the client is batchcast {major}.{minor} (protocol {batchcast.PROTOCOL_VERSION})" in msg
    assert f"the broker batchcast {major}.{minor + 1} (protocol {batchcast.PROTOCOL_VERSION + 1})" in msg
    assert f"pip install 'batchcast=={major}.{minor + 1}.*'" in msg
    assert e.value.code == "VersionMismatch"
