#!/usr/bin/env bash
# make gpu-check: the CUDA checks, for a machine with a GPU, run from what
# was built beforehand. Such a machine may reach no package registry and
# have no Go: on a machine that has them run `make wheel` (the wheel carries
# liboktopk and libzmq), bring the checkout with build/wheels, and run this.
# It installs the wheel with --no-deps beside the machine's own torch, runs
# the CUDA tests (tests/python/test_cuda.py), then times DDP steps on buckets
# of about 10^8 parameters (bench/gpu_step.py): plain DDP, the staging path
# and the device path, 2 and 4 ranks sharing GPU 0 over gloo, and over NCCL
# where there are at least 2 GPUs. Output: the terminal and
# $GPU_CHECK_OUT (default results/gpu_check.txt). Exits non-zero on any
# failure; about 5 minutes on one GPU. GPU_CHECK_DEVICE=cpu rehearses it
# without a GPU (the CUDA tests skip, the steps are timed on a small model).
DEVICE=${GPU_CHECK_DEVICE:-cuda}
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-results/gpu_check.txt}
mkdir -p "$(dirname "$OUT")"
exec > >(tee "$OUT") 2>&1

wheel=$(ls build/wheels/oktopk-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "gpu-check: no oktopk wheel in build/wheels: run 'make wheel' where Go and the package registries are, and bring build/wheels" >&2
    exit 2
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: torch sees no GPU here" >&2
    exit 2
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-deps --no-index --target "$site" "$wheel"
# The tests import the package from the checkout; the library is the wheel's.
export OKTOPK_LIBRARY="$site/oktopk/liboktopk.so"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu-check: $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), wheel $(basename "$wheel")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'

echo "== CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py -rs

echo "== DDP steps, ~10^8 parameters"
run_steps() {
    local size=()
    [ "$DEVICE" = cuda ] || size=(--layers 2 --width 512)
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$1" bench/gpu_step.py --backend "$2" --device "$DEVICE" "${size[@]}"
}
run_steps 2 gloo
run_steps 4 gloo
gpus=0
[ "$DEVICE" = cuda ] && gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    run_steps "$(( gpus < 4 ? gpus : 4 ))" nccl
else
    echo "NCCL: not timed ($gpus GPUs visible; NCCL needs a GPU per rank, at least 2)"
fi
echo "gpu-check: passed"
