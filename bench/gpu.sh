#!/usr/bin/env bash
# The GPU path end to end, in one call, on a machine with an NVIDIA GPU and
# PyTorch but no Rust toolchain. Prints one table (see bench/gpu_bench.py).
#
#   bash bench/gpu.sh --build   # here: the manylinux wheel (with the broker) into target/gpu-kit
#   bash bench/gpu.sh           # there, with target/gpu-kit carried along
#
# Extra arguments go to bench/gpu_bench.py (--batch, --batches).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=target/gpu-kit
if [[ "${1:-}" == "--build" ]]; then
    # The release's manylinux_2_28 wheel (it carries the broker; glibc 2.28
    # is enough on the GPU host), and its broker beside it for the harness.
    rm -rf "$KIT" && mkdir -p "$KIT"
    bash scripts/build-wheels "$KIT"
    rm -f "$KIT"/*.tar.gz
    strip -o "$KIT/batchcast" target/x86_64-unknown-linux-gnu/release/batchcast
    # A crate's unit tests as one executable linked against glibc 2.28
    # like the wheel: `tests OUT CARGO-ARGS..`.
    tests() {
        local out="$1" exe
        shift
        exe=$(PATH="$PWD/.venv/bin:$PATH" cargo zigbuild --locked -q "$@" --lib --tests \
            --target x86_64-unknown-linux-gnu.2.28 --message-format=json |
            .venv/bin/python -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line) if line.startswith("{") else {}
    if m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])')
        strip -o "$KIT/$out" "$exe"
    }
    # The Rust client's GPU tests (ignored without a GPU; named gpu_*),
    # and the broker's GPU backend conformance suite on CUDA
    # (gpu::conformance::gpu_cuda_backend, ignored without a GPU).
    tests client-gpu-tests -p batchcast --features cuda
    tests broker-gpu-tests -p batchcast-broker
    # pytest for the GPU tests (the GPU host reaches no package index).
    .venv/bin/pip download -q --disable-pip-version-check --only-binary :all: -d "$KIT/pytest" pytest
    ls -l "$KIT"
    exit 0
fi
if [[ ! -x "$KIT/batchcast" ]] || ! ls "$KIT"/batchcast-*.whl >/dev/null 2>&1; then
    echo "no broker or wheel in $KIT: run 'bash bench/gpu.sh --build' where Rust is, and carry $KIT" >&2
    exit 2
fi
PY="${PYTHON:-python3}"
# Beside the machine's own torch, never in a new venv: a venv made from a
# venv's python (torch images often ship one) sees the base interpreter's
# packages, not torch. The wheel has no dependencies to fetch.
SITE="${TMPDIR:-/tmp}/batchcast-gpu-site"
rm -rf "$SITE"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$SITE" "$KIT"/batchcast-*"$(uname -m)".whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, batchcast; print("torch", torch.__version__, "batchcast", batchcast.__file__)'
nvidia-smi -L 2>/dev/null || true
# The Rust client's GPU tests (client-rs, tests named gpu_*), the broker's
# GPU backend conformance suite on CUDA, then the Python client's
# (client-py/tests/test_gpu.py).
if [[ -x "$KIT/client-gpu-tests" ]]; then
    "$KIT/client-gpu-tests" --include-ignored --test-threads 1 gpu_
else
    echo "no client-gpu-tests in $KIT: the Rust GPU tests did not run" >&2
fi
if [[ -x "$KIT/broker-gpu-tests" ]]; then
    "$KIT/broker-gpu-tests" --include-ignored --test-threads 1 gpu_cuda_backend
else
    echo "no broker-gpu-tests in $KIT: the CUDA backend's conformance suite did not run" >&2
fi
if ls "$KIT"/pytest/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$SITE" "$KIT"/pytest/*.whl
    BATCHCAST_BIN="$KIT/batchcast" "$PY" -m pytest -q -p no:cacheprovider -rs client-py/tests/test_gpu.py
else
    echo "no pytest in $KIT: the GPU tests did not run (bash bench/gpu.sh --build brings it)" >&2
fi
exec "$PY" bench/gpu_bench.py --broker "$KIT/batchcast" "$@"
