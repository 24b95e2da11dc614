#!/usr/bin/env bash
# A host's stream made on the cluster's CPU nodes, by Ray Data or by the
# stream's own pipeline (feed_stream); bench/ray_data.py prints the tables.
# Usage: bench/ray_data.sh DATASET [--epochs 4] [--remote 0,1,2] [--native 1,2] [--dtype f32|u8]
#   (DATASET: a folder of JPEG photographs; make one with
#   `python bench/prepare_photos.py OUT`.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup
cargo build --release -q -p batchcast-cli
.venv/bin/python -c "import batchcast.ray; batchcast.ray.feed_stream" 2>/dev/null || {
    rm -rf target/bench-wheel
    bash scripts/build-wheels target/bench-wheel
    .venv/bin/pip install -q --force-reinstall --no-deps target/bench-wheel/batchcast-*.whl
}
exec .venv/bin/python bench/ray_data.py "$@"
