"""Datasets where they live: the same photographs read by one broker from
local disk, from a local S3 server (moto's), and from that server behind
20 ms and 50 ms of added latency per request; as an image folder and as
tar shards; with and without read-ahead and the disk tier. Then a burst
of 503 SlowDown answers in mid-run, and how fast throughput comes back.

Each row: one broker (workers = 1) and one consumer reading 3 epochs of
RandomResizedCrop(224) + flip + Normalize batches of 32; images/s as the
consumer saw them, the broker's CPU per image, and the S3 server's and
proxy's CPU per image (they share this machine's cores: stated, not
hidden). The latency is added by a proxy (tests/support/objserver.py)
before it forwards each request, as a longer round trip would.

Usage: python bench/remote.py DATASET [--epochs 3] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import EXE, REPO, image_stream, print

PY = sys.executable
OBJSERVER = str(REPO / "tests" / "support" / "objserver.py")
ENV = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_objserver(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([PY, OBJSERVER, *args], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline().split()[1])
    return p, f"http://127.0.0.1:{port}"


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return p, f"http://127.0.0.1:{port}"


def faults(proxy: str, spec: dict) -> dict:
    req = urllib.request.Request(f"{proxy}/__faults", data=json.dumps(spec).encode(), method="POST")
    return json.load(urllib.request.urlopen(req))


def make_shards(root: Path, out: Path, per_shard: int) -> int:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    samples = [(p, i) for i, c in enumerate(classes) for p in sorted((root / c).rglob("*.jpg"))]
    out.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(samples), per_shard):
        with tarfile.open(out / f"shard-{s // per_shard:06d}.tar", "w") as tar:
            for k, (p, label) in enumerate(samples[s:s + per_shard]):
                key = f"s{s + k:07d}"
                tar.add(p, arcname=f"{key}.jpg")
                data = str(label).encode()
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return (len(samples) + per_shard - 1) // per_shard


def stream_toml(dataset: str, remote: str | None, epochs: int) -> str:
    t = image_stream("bench", Path("/unused"), 32, epochs=epochs, workers=1, slots=8)
    if dataset.startswith("shards:"):
        pattern = dataset.split(":", 1)[1]
        t = t.replace('[stream.image_folder]\nroot = "/unused"',
                      f'[stream.webdataset]\nshards = "{pattern}"\nshuffle_buffer = 256')
    else:
        t = t.replace('root = "/unused"', f'root = "{dataset}"')
    if remote is not None:
        t += f"\n[stream.remote]\n{remote}\n"
    return t


def run_row(work: Path, dataset: str, remote: str | None, epochs: int, servers: list[int],
            burst: tuple[str, float] | None = None) -> dict:
    d = Path(tempfile.mkdtemp(dir=work))
    (d / "b.toml").write_text(stream_toml(dataset, remote, epochs))
    sock = d / "b.sock"
    broker = subprocess.Popen([EXE, "serve", "--config", str(d / "b.toml"), "--socket", str(sock)],
                              env=ENV, stdout=subprocess.DEVNULL, stderr=open(d / "broker.log", "w"))
    for _ in range(600):
        if sock.exists():
            break
        if broker.poll() is not None:
            raise SystemExit(f"broker failed: {(d / 'broker.log').read_text()[-2000:]}")
        time.sleep(0.05)
    b0, s0 = cpu_s(broker.pid), sum(cpu_s(p) for p in servers)
    consumer = subprocess.Popen([EXE, "consume", "--json", "--socket", str(sock), "--stream", "bench"],
                                stdout=subprocess.PIPE, text=True)
    timeline = []
    if burst is not None:
        t0 = time.monotonic()
        injected = False
        while consumer.poll() is None:
            st = json.loads(subprocess.run([EXE, "stats", "--json", "--socket", str(sock)],
                                           capture_output=True, text=True).stdout or "{}")
            made = sum(s["batches_produced"] for s in st.get("streams", []))
            timeline.append((time.monotonic() - t0, made))
            if not injected and timeline[-1][0] >= burst[1]:
                faults(burst[0], {"status": {"count": 400, "code": 503}})
                injected = True
            time.sleep(0.25)
    report = json.loads(consumer.communicate()[0])
    stats = json.loads(subprocess.run([EXE, "stats", "--json", "--socket", str(sock)],
                                      capture_output=True, text=True).stdout)
    b1, s1 = cpu_s(broker.pid), sum(cpu_s(p) for p in servers)
    broker.terminate()
    broker.wait()
    src = stats["streams"][0]["source"] or {}
    images = report["samples"]
    return {
        "ok": report["ok"],
        "images_s": images / report["seconds"],
        "broker_ms": (b1 - b0) * 1e3 / images,
        "servers_ms": (s1 - s0) * 1e3 / images,
        "remote": src.get("remote"),
        "timeline": timeline,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batchcast-remote-bench-"))
    try:
        bench(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(a, work: Path):
    root = a.dataset.resolve()
    n_shards = make_shards(root, work / "shards", 64)
    moto, s3 = start_moto()
    procs = [moto]
    try:
        subprocess.run([PY, OBJSERVER, "s3-load", s3, "data", str(root), "train/"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([PY, OBJSERVER, "s3-load", s3, "data", str(work / "shards"), "shards/"],
                       check=True, stdout=subprocess.DEVNULL)
        proxies = {}
        for ms in (0, 20, 50):
            p, url = start_objserver("proxy", s3, "--delay-ms", str(ms))
            procs.append(p)
            proxies[ms] = url
        pattern = f"shard-{{000000..{n_shards - 1:06d}}}.tar"
        datasets = {
            "image folder": (str(root), "s3://data/train/"),
            "tar shards": (f"shards:{work / 'shards' / pattern}", f"shards:s3://data/shards/{pattern}"),
        }
        rows = []
        pids = [p.pid for p in procs]
        for form, (local, remote_url) in datasets.items():
            base = run_row(work, local, None, a.epochs, pids)
            rows.append((form, "local disk", "-", base))
            print(f"{form}: local {base['images_s']:.0f} images/s")
            for ms in (0, 20, 50):
                for ahead, keys in (("off", "read_ahead = 0"), ("on", "read_ahead = 64\nread_ahead_mib = 256")):
                    r = run_row(work, remote_url, f'endpoint = "{proxies[ms]}"\n{keys}', a.epochs, pids)
                    where = "S3 server" + (f" + {ms} ms" if ms else "")
                    rows.append((form, where, ahead, r))
                    print(f"{form}: {where}, read-ahead {ahead}: {r['images_s']:.0f} images/s")
            cache = work / f"cache-{len(rows)}"
            r = run_row(work, remote_url, f'endpoint = "{proxies[20]}"\nread_ahead = 64\n'
                        f'cache_dir = "{cache}"\ncache_dir_mib = 4096', a.epochs, pids)
            rows.append((form, "S3 server + 20 ms", "on, + disk tier", r))
            print(f"{form}: + disk tier {r['images_s']:.0f} images/s")
        print_rows(rows)
        burst = run_row(work, datasets["image folder"][1],
                        f'endpoint = "{proxies[20]}"\nread_ahead = 64\nretries = 10', max(a.epochs, 4), pids,
                        burst=(proxies[20], 6.0))
        print_burst(burst)
    finally:
        for p in procs:
            p.kill()


def print_rows(rows):
    print("\n| dataset | read from | read-ahead | images/s | vs local | broker CPU-ms/image | "
          "S3 server + proxy CPU-ms/image | requests | pipeline waited (s) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    base = {}
    for form, where, ahead, r in rows:
        if where == "local disk":
            base[form] = r["images_s"]
        rem = r["remote"] or {}
        print(f"| {form} | {where} | {ahead} | {r['images_s']:.0f} | {r['images_s'] / base[form]:.2f}x | "
              f"{r['broker_ms']:.2f} | {r['servers_ms']:.2f} | {rem.get('requests', '-')} | "
              f"{rem.get('waited_s', 0):.1f} |")


def print_burst(r):
    tl = r["timeline"]
    rates = [(t1, (m1 - m0) * 32 / (t1 - t0)) for (t0, m0), (t1, m1) in zip(tl, tl[1:]) if t1 > t0]

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    before = med([v for t, v in rates if 2.0 <= t < 6.0])
    during = med([v for t, v in rates if 6.0 <= t < 8.0])
    after = med([v for t, v in rates if t >= 10.0])
    rem = r["remote"] or {}
    print("\n| image folder, S3 server + 20 ms, read-ahead on | images/s (median of 0.25 s windows) |")
    print("|---|---:|")
    print(f"| before the burst (2-6 s) | {before:.0f} |")
    print(f"| the 2 s after 400 answers of 503 SlowDown (6-8 s) | {during:.0f} |")
    print(f"| from 10 s on | {after:.0f} |")
    print(f"\nthrottled {rem.get('throttled')}, retries {rem.get('retries')}, failed {rem.get('failed')}, "
          f"concurrency at the end {rem.get('concurrency')}")


if __name__ == "__main__":
    main()
