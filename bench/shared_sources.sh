#!/usr/bin/env bash
# Shared source benchmark: builds release binaries and prints two markdown
# tables (three streams on one source vs independent; per-op CPU, native vs
# Pillow). Usage: bench/shared_sources.sh DATASET [harness options]
# (DATASET: an ImageFolder; make one with `python bench/prepare_photos.py OUT`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-cli -p batchcast-bench
exec target/release/shared_sources "$@"
