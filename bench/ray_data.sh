#!/usr/bin/env bash
# A host's stream made by Ray Data on the cluster's CPU nodes (bench/ray_data.py
# prints the tables).
# Usage: bench/ray_data.sh DATASET [--epochs 4] [--remote 0,1,2]
#   (DATASET: a folder of JPEG photographs; make one with
#   `python bench/prepare_photos.py OUT`.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-broker
.venv/bin/python -c "import batchcast.ray" 2>/dev/null || {
    rm -rf target/bench-wheel
    bash scripts/build-wheels target/bench-wheel
    .venv/bin/pip install -q --force-reinstall --no-deps target/bench-wheel/batchcast-*.whl
}
exec .venv/bin/python bench/ray_data.py "$@"
