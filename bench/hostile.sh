#!/usr/bin/env bash
# Hostile clients benchmark: the owner's first batch, broker memory, stats
# and SIGINT while another uid floods the broker (needs root for that
# part), and an exactly-once check under random SIGKILLs of consumers.
# Builds release binaries and prints a markdown table. Extra arguments go
# to the harness (see `target/release/hostile --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p batchcast-cli -p batchcast-bench
exec target/release/hostile "$@"
