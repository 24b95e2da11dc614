"""Datasets where they live: the same photographs read by one broker from
local disk; from nginx (plain HTTP with range requests, the folder through
a manifest) and from s3s-fs (an S3 server in Rust over a folder, from the
s3s project, checking SigV4 signatures), each directly and behind 20 ms
and 50 ms of added round trip; as an image folder and as tar shards; with
read-ahead off and on, and with the disk tier. moto's S3 server (Python,
the one the tests use) gives one reference row: a server whose own CPU
bounds it. Then a burst of 400 answers of 503 SlowDown in mid-run, and
how throughput comes back.

Each row: one broker (workers = 1) and one consumer reading 6 epochs of
RandomResizedCrop(224) + flip + Normalize batches of 32 (1 epoch without
read-ahead); images/s as the consumer saw them, the median of --repeat
runs for the local and read-ahead rows (one run for the slow rows without
it); the broker's CPU per image, and the servers' and proxies' CPU per
image (they share this machine's cores: stated, not hidden). The servers
and proxies run at nice 19 (--server-nice): they stand in for a store on
other machines, so they take the cores the broker leaves rather than half
of its two; one row runs them at the broker's priority, for contrast.
The round trip is added by a TCP proxy (bench/src/latency_proxy.rs: each
byte delayed half the RTT each way, bandwidth unlimited), since this
kernel has no netem. Read-ahead "on" is 256 units, 128 requests, 16 MiB,
2 MiB shard parts: a third of the dataset, so every epoch fetches nearly
all of it again.

Usage: python bench/remote.py DATASET [--epochs 6] [--repeat 3]
    [--only "image folder"|"tar shards"]
(bench/remote.sh installs nginx, runs scripts/setup for moto and s3s-fs,
builds, and runs this.)
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

from _common import EXE, REPO, image_stream, print, serve

PY = sys.executable
OBJSERVER = str(REPO / "tests" / "support" / "objserver.py")
ENV = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")


def family(pid: int) -> list[int]:
    """`pid` and its descendants (nginx's worker, say)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its descendants."""
    total = 0
    for p in family(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(parts[11]) + int(parts[12])
    return total / os.sysconf("SC_CLK_TCK")


def renice(pids: list[int], nice: int):
    """Every thread of `pids` (and their descendants) at `nice`: the
    servers stand in for a store elsewhere, so they take only the cores
    the broker leaves (see --server-nice)."""
    for pid in pids:
        for p in family(pid):
            try:
                for tid in os.listdir(f"/proc/{p}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except (ProcessLookupError, FileNotFoundError):
                pass  # a thread or process that ended meanwhile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int):
    """Returns once something listens on `port`; fails after about 10 s."""
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on port {port} after 10 s: the server did not start")


def start_objserver(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([PY, OBJSERVER, *args], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline().split()[1])
    return p, f"http://127.0.0.1:{port}"


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, f"http://127.0.0.1:{port}"


def start_s3s(root: Path) -> tuple[subprocess.Popen, str]:
    """s3s-fs serving `root` (its folders are buckets) with the bench's
    key pair."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    exe = os.environ.get("S3S_FS") or str(REPO / ".venv" / "s3s-fs" / "bin" / "s3s-fs")
    p = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--access-key", ENV["AWS_ACCESS_KEY_ID"],
                          "--secret-key", ENV["AWS_SECRET_ACCESS_KEY"], str(root)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
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


def stream_toml(dataset: str, remote: str | None, epochs: int, manifest: str | None = None) -> str:
    t = image_stream("bench", Path("/unused"), 32, epochs=epochs, workers=1, slots=8)
    if dataset.startswith("shards:"):
        pattern = dataset.split(":", 1)[1]
        t = t.replace('[stream.image_folder]\nroot = "/unused"',
                      f'[stream.webdataset]\nshards = "{pattern}"\nshuffle_buffer = 256')
    else:
        t = t.replace('root = "/unused"', f'root = "{dataset}"' + (f"\n{manifest}" if manifest else ""))
    if remote is not None:
        t += f"\n[stream.remote]\n{remote}\n"
    return t


def run_row(work: Path, dataset: str, remote: str | None, epochs: int, servers: list[int],
            burst: tuple[str, float] | None = None, manifest: str | None = None) -> dict:
    d = Path(tempfile.mkdtemp(dir=work))
    broker, sock = serve(d, stream_toml(dataset, remote, epochs, manifest), ENV)
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
        "first_batch_s": report.get("first_batch_s", 0.0),
        "timeline": timeline,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each local and read-ahead row (the median is shown)")
    ap.add_argument("--server-nice", type=int, default=19,
                    help="nice value of the servers and proxies (they stand in for a store on "
                         "other machines; one row runs them at the broker's priority)")
    ap.add_argument("--only", choices=["image folder", "tar shards"],
                    help="one form's rows (and the 503 burst with the shards)")
    ap.add_argument("--servers", default="http,s3,moto,pyhttp",
                    help="the servers whose rows run, of http (nginx), s3 (s3s-fs; its disk-tier "
                         "row and the 503 burst too), moto and pyhttp (python -m http.server: "
                         "no range requests, so image folder rows only)")
    ap.add_argument("--skip-off", action="store_true",
                    help="leave out the rows without read-ahead (slow: one epoch each)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batchcast-remote-bench-"))
    try:
        bench(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def start_nginx(work: Path, www: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    user = "user root;" if os.getuid() == 0 else ""
    conf = work / "nginx.conf"
    conf.write_text(f"""{user}
worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/nginx.err;
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; keepalive_requests 1000000;
  server {{ listen 127.0.0.1:{port}; root {www}; }} }}
""")
    p = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(work)], stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, f"http://127.0.0.1:{port}"


def start_pyhttp(www: Path) -> tuple[subprocess.Popen, str]:
    """Python's own `http.server` (threaded, no range requests): a plain
    server that takes few requests at a time well."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                          "--directory", str(www)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, f"http://127.0.0.1:{port}"


def start_latency(upstream: str, one_way_ms: float) -> tuple[subprocess.Popen, str]:
    exe = str(REPO / "target" / "release" / "latency_proxy")
    host = upstream.split("//", 1)[1]
    p = subprocess.Popen([exe, "0", host, str(one_way_ms)], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline().split()[1])
    return p, f"http://127.0.0.1:{port}"


AHEAD = {
    "defaults": "",
    "requests = 8": "requests = 8",
    "off": "read_ahead = 0",
    "on": "read_ahead = 256\nrequests = 128\nread_ahead_mib = 16\npart_mib = 2",
}


def median_row(runs: list[dict]) -> dict:
    """The run with the median images/s (its CPU and counters with it)."""
    return sorted(runs, key=lambda r: r["images_s"])[len(runs) // 2]


def bench(a, work: Path):
    root = a.dataset.resolve()
    www = work / "www"
    shutil.copytree(root, www / "train")
    n_shards = make_shards(root, www / "shards", 64)
    files = sorted(str(p.relative_to(www / "train")) for p in (www / "train").rglob("*.jpg"))
    (www / "train" / "MANIFEST").write_text("\n".join(files) + "\n")
    procs = []
    try:
        servers = a.servers.split(",")
        up = {}  # server -> its URL, for those that run
        if "moto" in servers:
            moto, up["moto"] = start_moto()
            procs.append(moto)
            for src, prefix in ((root, "train/"), (www / "shards", "shards/")):
                subprocess.run([PY, OBJSERVER, "s3-load", up["moto"], "data", str(src), prefix], check=True,
                               stdout=subprocess.DEVNULL)
        if "http" in servers:
            nginx, up["http"] = start_nginx(work, www)
            procs.append(nginx)
        if "s3" in servers:
            s3s, up["s3"] = start_s3s(work / "s3s")
            procs.append(s3s)
            # Uploaded, not copied into its folder: s3s-fs keeps the ETag
            # of an object it was sent, and hashes a copied-in file's whole
            # content on every GET (5 CPU-ms per shard member).
            for src, prefix in ((root, "train/"), (www / "shards", "shards/")):
                subprocess.run([PY, OBJSERVER, "s3-load", up["s3"], "data", str(src), prefix], check=True,
                               stdout=subprocess.DEVNULL, env=ENV)
        if "pyhttp" in servers:
            pyhttp, up["pyhttp"] = start_pyhttp(www)
            procs.append(pyhttp)
        via = {}
        rtts = {"http": (0, 20, 50), "s3": (0, 20, 50), "moto": (20,), "pyhttp": (0, 20)}
        for name, url in up.items():
            for rtt in rtts[name]:
                p, via[(name, rtt)] = start_latency(url, rtt / 2)
                procs.append(p)
        pids = [p.pid for p in procs]
        pattern = f"shard-{{000000..{n_shards - 1:06d}}}.tar"
        forms = {
            "image folder": (str(www / "train"), "{http}/train/", "s3://data/train/", 'manifest = "MANIFEST"'),
            "tar shards": (f"shards:{www / 'shards' / pattern}", f"shards:{{http}}/shards/{pattern}",
                           f"shards:s3://data/shards/{pattern}", None),
        }
        if a.only:
            forms = {a.only: forms[a.only]}
        names = {"http": "nginx (HTTP)", "s3": "s3s-fs (S3)", "moto": "moto (S3)",
                 "pyhttp": "python -m http.server (HTTP)"}
        grid = [(server, rtt, ahead, a.server_nice) for server in ("http", "s3") for rtt in (0, 20, 50)
                for ahead in ("off", "on") if not (ahead == "off" and rtt == 50)]
        grid.append(("moto", 20, "on", a.server_nice))
        # The servers' CPU taken from the broker's two cores, for contrast.
        if a.server_nice != 0:
            grid.append(("s3", 20, "on", 0))
        # A plain server with the defaults (the gate finds what it takes).
        grid += [("pyhttp", rtt, ahead, a.server_nice) for rtt in (0, 20) for ahead in ("defaults", "requests = 8")]
        grid = [g for g in grid if g[0] in servers and not (a.skip_off and g[2] == "off")]
        rows = []
        for form, (local, http_url, s3_url, manifest) in forms.items():
            base = median_row([run_row(work, local, None, a.epochs, pids) for _ in range(a.repeat)])
            rows.append((form, "local disk", "-", base))
            print(f"{form}: local {base['images_s']:.0f} images/s")
            for server, rtt, ahead, nice in grid:
                if server == "pyhttp" and form != "image folder":
                    continue
                renice(pids, nice)
                url = via[(server, rtt)]
                if server in ("http", "pyhttp"):
                    dataset = http_url.replace("{http}", url)
                    keys = AHEAD[ahead]
                else:
                    dataset = s3_url
                    keys = f'endpoint = "{url}"\n{AHEAD[ahead]}'
                # Without read-ahead a row is slow: one epoch, one run.
                epochs, runs = (1, 1) if ahead == "off" else (a.epochs, a.repeat)
                r = median_row([run_row(work, dataset, keys, epochs, pids,
                                        manifest=manifest if server in ("http", "pyhttp") else None)
                                for _ in range(runs)])
                where = names[server] + (f" + {rtt} ms RTT" if rtt else "")
                if nice != a.server_nice:
                    where += f", servers at nice {nice}"
                rows.append((form, where, ahead, r))
                print(f"{form}: {where}, read-ahead {ahead}: {r['images_s']:.0f} images/s")
            if "s3" not in servers:
                continue
            # The disk tier: epoch 1 from the store, the rest from disk.
            renice(pids, a.server_nice)
            cache = work / f"cache-{len(rows)}"
            r = run_row(work, s3_url, f'endpoint = "{via[("s3", 20)]}"\n{AHEAD["on"]}\n'
                        f'cache_dir = "{cache}"\ncache_dir_mib = 4096', a.epochs, pids)
            rows.append((form, names["s3"] + " + 20 ms RTT", "on, + disk tier", r))
            print(f"{form}: + disk tier {r['images_s']:.0f} images/s")
        print_rows(rows)
        if "tar shards" not in forms or "s3" not in servers:
            return
        proxy, purl = start_objserver("proxy", up["s3"])
        procs.append(proxy)
        renice(pids + [proxy.pid], a.server_nice)
        burst = run_row(work, forms["tar shards"][2], f'endpoint = "{purl}"\n{AHEAD["on"]}\nretries = 10',
                        40, pids + [proxy.pid], burst=(purl, 3.0))
        print_burst(burst)
    finally:
        # SIGTERM lets nginx stop its workers too; a wait reaps each.
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def print_rows(rows):
    print("\n| dataset | read from | read-ahead | images/s | vs local | broker CPU-ms/image | "
          "S3 server + proxy CPU-ms/image | requests | retries | first batch (s) | pipeline waited (s) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {}
    for form, where, ahead, r in rows:
        if where == "local disk":
            base[form] = r["images_s"]
        rem = r["remote"] or {}
        print(f"| {form} | {where} | {ahead} | {r['images_s']:.0f} | {r['images_s'] / base[form]:.2f}x | "
              f"{r['broker_ms']:.2f} | {r['servers_ms']:.2f} | {rem.get('requests', '-')} | "
              f"{rem.get('retries', '-')} | {r['first_batch_s']:.2f} | {rem.get('waited_s', 0):.1f} |")


def print_burst(r):
    tl = r["timeline"]
    rates = [(t1, (m1 - m0) * 32 / (t1 - t0)) for (t0, m0), (t1, m1) in zip(tl, tl[1:]) if t1 > t0]

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    before = med([v for t, v in rates if 1.0 <= t < 3.0])
    during = med([v for t, v in rates if 3.0 <= t < 5.0])
    after = med([v for t, v in rates if t >= 6.0])
    rem = r["remote"] or {}
    print("\n| tar shards, s3s-fs (S3) behind the fault proxy, read-ahead on | images/s (median of 0.25 s windows) |")
    print("|---|---:|")
    print(f"| before the burst (1-3 s) | {before:.0f} |")
    print(f"| the 2 s after 400 answers of 503 SlowDown (3-5 s) | {during:.0f} |")
    print(f"| from 6 s on | {after:.0f} |")
    print(f"\nrun: {len(rates)} windows over {tl[-1][0] if tl else 0:.1f} s")
    print(f"\nrequests {rem.get('requests')}, throttled {rem.get('throttled')}, retries {rem.get('retries')}, failed {rem.get('failed')}, "
          f"concurrency at the end {rem.get('concurrency')}")


if __name__ == "__main__":
    main()
