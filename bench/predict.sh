#!/usr/bin/env bash
# `batchcast doctor`'s predictions checked against the changes made:
# decode-, trainer- and I/O-bound scenarios (bench/predict.py prints the
# table).
# Usage: bench/predict.sh PHOTOS [--repeat 3] [--seconds 4]
#   (PHOTOS: a folder of JPEG photographs; make one with
#   `python bench/prepare_photos.py OUT --sizes imagenet`.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-cli -p batchcast-bench --bin batchcast --bin latency_proxy
if ! command -v nginx >/dev/null; then
    echo "== installing nginx (Debian) for the I/O-bound scenario"
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y -q nginx-light >/dev/null 2>&1 ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q nginx-light >/dev/null; }
fi
exec .venv/bin/python bench/predict.py "$@"
