#!/usr/bin/env bash
# Image pipeline benchmark: builds release binaries and prints two tables.
# Usage: bench/images.sh DATASET [harness options]   (DATASET: an ImageFolder;
# make one of real photographs with `python bench/prepare_photos.py OUT`).
# It also measures the dataset as `batchcast prepare` copies it (restart
# markers), made in a temporary folder, unless --prepared DIR is given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-cli -p batchcast-bench
dataset="$1"
shift
if [[ " $* " != *" --prepared "* ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    target/release/batchcast prepare "$dataset" "$tmp/prepared" >&2
    set -- "$@" --prepared "$tmp/prepared"
fi
target/release/images "$dataset" "$@"
