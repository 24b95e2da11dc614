#!/usr/bin/env bash
# The same photographs read from local disk, nginx (HTTP) and s3s-fs (S3;
# moto for one reference row), directly and behind 20 and 50 ms of added
# round trip; image folder and tar shards; read-ahead off and on, the disk
# tier; a burst of 503 SlowDown (bench/remote.py prints the tables).
# Usage: bench/remote.sh DATASET [--epochs 6] [--repeat 3] [--only FORM]
#   (DATASET: a folder of JPEG photographs; make one with
#   `python bench/prepare_photos.py OUT`.)
set -euo pipefail
cd "$(dirname "$0")/.."
# nginx below; moto, s3s-fs and the rest from scripts/setup.
bash scripts/setup --bench
cargo build --release -q -p batchcast-cli -p batchcast-bench --bin batchcast --bin latency_proxy
if ! command -v nginx >/dev/null; then
    echo "== installing nginx (Debian) for the HTTP rows"
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y -q nginx-light >/dev/null 2>&1 ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q nginx-light >/dev/null; }
fi
exec .venv/bin/python bench/remote.py "$@"
