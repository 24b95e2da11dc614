#!/usr/bin/env bash
# Riding through a broker restart (bench/restart.py): the trainers' pause,
# plain restart vs socket-activated, and the replay CPU. Builds the release
# broker and a release wheel into .venv (`scripts/build-wheels --native`), makes the demo images if needed,
# and prints a markdown table. Extra arguments go to bench/restart.py.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf target/bench-wheel
bash scripts/build-wheels --native target/bench-wheel >/dev/null
.venv/bin/pip install -q --force-reinstall --no-deps target/bench-wheel/batchcast-*.whl
images=$(.venv/bin/python -c 'import os; print(os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchcast", "demo-images-v1"))')
[ -e "$images/.complete" ] || target/release/batchcast demo --consumers 1 --epochs 1 --no-baseline >/dev/null
exec .venv/bin/python bench/restart.py --broker target/release/batchcast --images "$images" "$@"
