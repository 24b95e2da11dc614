#!/usr/bin/env bash
# Mixed batch sizes benchmark: builds release binaries and prints markdown
# tables. Extra arguments go to the harness (`target/release/batch_sizes --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p batchcast-cli -p batchcast-bench
exec target/release/batch_sizes "$@"
