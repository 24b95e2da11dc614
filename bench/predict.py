"""`batchcast doctor`'s predictions, checked: for each scenario (a
bottleneck), a broker and its trainers run as they are and `doctor
--json` watches them; the change it priced is then made (another broker,
the same trainers) and doctor watches again. Predicted images/s and stall
against measured, with the error, per change; alternating runs, the
median of --repeat.

Scenarios (300 ImageNet-sized photos, RandomResizedCrop(224) + flip +
Normalize to f32, batches of 32, trainers are `batchcast consume`):

* decode-bound: 1 pipeline thread, 2 trainers stepping --decode-step-ms
  a batch (more than the thread makes); changes: workers = 2, 3 trainers.
* trainer-bound: 2 pipeline threads, 2 trainers sleeping --step-ms a
  batch; change: 3 trainers.
* I/O-bound: the photos from nginx behind a 20 ms round trip
  (bench/src/latency_proxy.rs), read-ahead off, 2 pipeline threads,
  2 trainers; changes: workers = 3, cache_mib that holds the dataset
  (measured once the first epoch filled it), read-ahead on. nginx and
  the proxy run at nice 19: they stand in for a store on other machines
  (as in bench/remote.py).

Usage: python bench/predict.py PHOTOS [--repeat 3] [--seconds 4]
(bench/predict.sh installs nginx, builds, and runs it.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import EXE, image_stream, print, serve
from remote import family, renice, start_latency, start_nginx

BATCH = 32


def stream(root: str, workers: int, extra: str = "", **keys) -> str:
    t = image_stream("bench", Path("/unused"), BATCH, epochs=100000, workers=workers, slots=8, **keys)
    t = t.replace('root = "/unused"', f'root = "{root}"' + (f"\n{extra}" if extra else ""))
    return t


def run(work: Path, toml: str, trainers: int, step_ms: int, seconds: float, settle) -> dict:
    """One broker serving `toml` and `trainers` consumers; doctor's JSON
    finding once `settle(stats)` holds (and at least 2 s have passed)."""
    d = Path(tempfile.mkdtemp(dir=work))
    broker, sock = serve(d, toml)
    consumers = []
    try:
        consumers = [subprocess.Popen([EXE, "consume", "--socket", str(sock), "--stream", "bench",
                                       "--sleep-ms", str(step_ms)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for _ in range(trainers)]
        t0 = time.monotonic()
        while True:
            time.sleep(0.5)
            st = json.loads(subprocess.run([EXE, "stats", "--json", "--socket", str(sock)],
                                           capture_output=True, text=True, check=True).stdout)
            if time.monotonic() - t0 >= 2.0 and settle(st["streams"][0]):
                break
            if time.monotonic() - t0 > 120:
                raise SystemExit("the run did not settle in 120 s")
        out = subprocess.run([EXE, "doctor", "--json", "--seconds", str(seconds), "--socket", str(sock)],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)[0]
    finally:
        for c in consumers:
            c.kill()
            c.wait()
        broker.terminate()
        broker.wait()
        shutil.rmtree(d, ignore_errors=True)


def always(_s) -> bool:
    return True


def second_epoch(s) -> bool:
    return s["epoch"] >= 2


def scenarios(photos: Path, http: str, step_ms: int, decode_step_ms: int) -> list[dict]:
    local, remote = str(photos), f"{http}/train/"
    off = 'manifest = "MANIFEST"\n\n[stream.remote]\nread_ahead = 0'
    on = 'manifest = "MANIFEST"\n\n[stream.remote]\nread_ahead = 256\nrequests = 128'
    return [
        dict(name="decode-bound", base=(stream(local, 1), 2, decode_step_ms), changes=[
            ("workers", "workers = 2", (stream(local, 2), 2, decode_step_ms), always),
            ("one-more-trainer", "3 trainers", (stream(local, 1), 3, decode_step_ms), always),
        ]),
        dict(name="trainer-bound", base=(stream(local, 2), 2, step_ms), changes=[
            ("one-more-trainer", "3 trainers", (stream(local, 2), 3, step_ms), always),
        ]),
        dict(name="I/O-bound (HTTP, 20 ms RTT, no read-ahead)", base=(stream(remote, 2, off), 2, 0), changes=[
            ("workers", "workers = 3", (stream(remote, 3, off), 2, 0), always),
            ("cache", "cache_mib = 256", (stream(remote, 2, off, cache_mib=256), 2, 0), second_epoch),
            ("read-ahead", "read-ahead on (requests = 128)", (stream(remote, 2, on), 2, 0), always),
        ]),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("photos", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="doctor's watch")
    ap.add_argument("--step-ms", type=int, default=50, help="the trainer-bound trainers' step per batch")
    ap.add_argument("--decode-step-ms", type=int, default=12, help="the decode-bound trainers' step per batch")
    ap.add_argument("--only", help="scenarios whose name starts with this")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batchcast-predict-bench-"))
    www = work / "www"
    shutil.copytree(a.photos.resolve(), www / "train")
    files = sorted(str(p.relative_to(www / "train")) for p in (www / "train").rglob("*.jpg"))
    (www / "train" / "MANIFEST").write_text("\n".join(files) + "\n")
    server, url = start_nginx(work, www)
    proxy, via = start_latency(url, 10.0)
    renice([server.pid, proxy.pid] + family(server.pid), 19)
    rows = []
    try:
        for sc in scenarios(www / "train", via, a.step_ms, a.decode_step_ms):
            if a.only and not sc["name"].startswith(a.only):
                continue
            runs = {c[0]: [] for c in sc["changes"]}
            for rep in range(a.repeat):
                base = run(work, *sc["base"], a.seconds, always)
                for key, _what, (toml, n, step), settle in sc["changes"]:
                    after = run(work, toml, n, step, a.seconds, settle)
                    pred = next(p for p in base["model"]["predictions"] if p["change"] == key)
                    runs[key].append((base, pred, after))
                    print(f"{sc['name']} #{rep + 1}: {key}: base {base['model']['inputs']['images_s']:.0f}, "
                          f"predicted {pred['images_s']:.0f}, measured {after['model']['inputs']['images_s']:.0f}")
            for key, what, _cfg, _settle in sc["changes"]:
                rows.append((sc["name"], what, runs[key]))
        print_rows(rows)
    finally:
        for p in (proxy, server):
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def print_rows(rows):
    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    print("\n| scenario (verdict) | change | before: measured (model) images/s | predicted images/s "
          "| measured after | error | predicted stall | measured stall | limit after (model) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for name, what, runs in rows:
        # The run with the median error stands for the row.
        errs = [a["model"]["inputs"]["images_s"] / p["images_s"] - 1 for _b, p, a in runs]
        k = sorted(range(len(runs)), key=lambda i: errs[i])[len(runs) // 2]
        b, p, a = runs[k]
        stall = p.get("stall")
        print(f"| {name} ({b['bound']}) | {what} | {b['model']['inputs']['images_s']:.0f} "
              f"({b['model']['now']['images_s']:.0f}) | {p['images_s']:.0f} | {a['model']['inputs']['images_s']:.0f} "
              f"| {100 * errs[k]:+.0f} % (runs: {', '.join(f'{100 * e:+.0f}' for e in errs)}) "
              f"| {'-' if stall is None else f'{100 * stall:.0f} %'} | {100 * stall_of(a):.0f} % | {p['limit']} |")


def stall_of(f: dict) -> float:
    ev = dict(f["evidence"])
    return float(ev["trainers' data stall (median)"].split(" %")[0]) / 100


if __name__ == "__main__":
    main()
