"""Fan-out before and after: runs `fanout --consumers 1 --consumers 8` of
two release builds, alternating, and prints the medians as a table.

Usage: python3 bench/ab_fanout.py BEFORE_RELEASE_DIR AFTER_RELEASE_DIR [RUNS]
(each dir holds that build's `fanout` and `batchcast`, e.g. a worktree's
`target/release`).
"""
import re
import statistics
import subprocess
import sys

if len(sys.argv) < 3:
    sys.exit(__doc__)
builds = {"before": sys.argv[1], "after": sys.argv[2]}
rows = {}
ratios = {}
N = int(sys.argv[3]) if len(sys.argv) > 3 else 5
for i in range(N):
    for name, d in builds.items():
        out = subprocess.run([f"{d}/fanout", "--exe", f"{d}/batchcast", "--consumers", "1", "--consumers", "8",
                              "--batches", "50000", "--full-batches", "20"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) >= 8 and c[0] in ("stamp", "full"):
                key = (c[0], c[1], c[2])
                rows.setdefault((name, key), []).append((float(c[3]), float(c[7])))
            m = re.match(r"broker CPU per batch, 8 consumers vs 1 \(stamp, (\w+)\): ([\d.]+)x", line)
            if m:
                ratios.setdefault((name, m.group(1)), []).append(float(m.group(2)))
        print(name, i, file=sys.stderr, flush=True)
keys = sorted({k for (_, k) in rows})
print("| fill | transport | consumers | batches/s per consumer, median (before → after) | broker CPU-s / 1000 batches, median (before → after) |")
print("|---|---|---:|---:|---:|")
for k in keys:
    b = rows.get(("before", k), []); a = rows.get(("after", k), [])
    if not b or not a: continue
    mb = statistics.median(x[0] for x in b); ma = statistics.median(x[0] for x in a)
    cb = statistics.median(x[1] for x in b); ca = statistics.median(x[1] for x in a)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {mb:.0f} → {ma:.0f} | {cb:.4f} → {ca:.4f} |")
for t in ("mailbox", "socket"):
    b = ratios.get(("before", t), []); a = ratios.get(("after", t), [])
    if b and a:
        print(f"8 vs 1 broker CPU per batch ({t}): median {statistics.median(b):.2f}x → {statistics.median(a):.2f}x; before {sorted(b)}; after {sorted(a)}")
print(f"runs: {N} of each, alternating")
