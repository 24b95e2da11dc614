#!/usr/bin/env bash
# Data-parallel trials on one host: groups on one broker vs a DataLoader per
# rank (bench/groups.py prints the tables).
# Usage: bench/groups.sh DATASET [--epochs 3] [--batch 32]
#   (DATASET: an ImageFolder; make one of real photographs with
#   `python bench/prepare_photos.py OUT`.)
# PYTHON picks the interpreter (default .venv/bin/python); torch and
# torchvision are installed into it when missing (torch: about 90 s and
# 5.4 GB, PyPI's Linux wheel brings its CUDA libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ "$PYTHON" = ".venv/bin/python" ] && bash scripts/setup
cargo build --release -q -p batchcast-cli
if ! "$PYTHON" -c "import torch, torchvision" 2>/dev/null; then
    echo "== installing torch and torchvision into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
    "$PYTHON" -m pip install -q --no-cache-dir --disable-pip-version-check torch torchvision
fi
if ! "$PYTHON" -c "import batchcast" 2>/dev/null; then
    rm -rf target/bench-wheel
    bash scripts/build-wheels target/bench-wheel
    "$PYTHON" -m pip install -q --force-reinstall --no-deps target/bench-wheel/batchcast-*.whl
fi
exec "$PYTHON" bench/groups.py "$@"
