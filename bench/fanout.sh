#!/usr/bin/env bash
# Fan-out benchmark: builds release binaries and prints a markdown table.
# Extra arguments go to the harness (see `target/release/fanout --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p batchcast-cli -p batchcast-bench
exec target/release/fanout "$@"
