#!/usr/bin/env bash
# Late join benchmark: builds release binaries and prints a markdown table.
# Extra arguments go to the harness (`target/release/late_join --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p batchcast-cli -p batchcast-bench
exec target/release/late_join "$@"
