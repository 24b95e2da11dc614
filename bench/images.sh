#!/usr/bin/env bash
# Image pipeline benchmark: builds release binaries and prints two tables.
# Usage: bench/images.sh DATASET [harness options]   (DATASET: an ImageFolder;
# make one of real photographs with `python bench/prepare_photos.py OUT`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-broker -p batchcast-bench
exec target/release/images "$@"
