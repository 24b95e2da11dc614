#!/usr/bin/env bash
# The same photographs read from local disk, a local S3 server (moto), and
# that server behind 20 and 50 ms of added latency; image folder and tar
# shards; read-ahead off and on, the disk tier; a burst of 503 SlowDown
# (bench/remote.py prints the tables).
# Usage: bench/remote.sh DATASET [--epochs 3]
#   (DATASET: a folder of JPEG photographs; make one with
#   `python bench/prepare_photos.py OUT`.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-broker
exec .venv/bin/python bench/remote.py "$@"
