#!/usr/bin/env bash
# The frameworks on the emulated cluster (results/frameworks.md): each
# framework's plain run against the same script with the one line, P ranks
# behind a RATE link each (bench/cluster.sh), in two orders (plain first,
# then the hook first), every rank's step times printed, then summed up by
# bench/frameworks_report.py: per step, the slowest rank's time (the one a
# synchronous step waits for), over the steps after the hook's 2-step
# warm-up.
#
#   bench/frameworks.sh FW_PY [OUT]       (make bench-frameworks)
#
# FW_PY: the frameworks virtualenv's python (make venv-frameworks). The
# models: torchvision's VGG-16 (examples/frameworks/vgg16_fashion.py, SGD
# with momentum) and BERT pre-training under Hugging Face's Trainer
# (examples/frameworks/hf_trainer.py, its default AdamW and clipping) at
# hidden size BENCH_FW_BERT_HIDDEN over BENCH_FW_BERT_LAYERS layers.
# BENCH_MODE=loopback runs the ranks on 127.0.0.1 with no limit (no root).
set -euo pipefail
FW_PY=${1:?usage: bench/frameworks.sh FW_PY [OUT]}
OUT=${2:-build/bench-frameworks}
P=${BENCH_FW_P:-4}
STEPS=${BENCH_FW_STEPS:-22}
MODELS=${BENCH_FW_MODELS:-vgg16 bert}
HIDDEN=${BENCH_FW_BERT_HIDDEN:-256}
LAYERS=${BENCH_FW_BERT_LAYERS:-4}
export BENCH_MODE=${BENCH_MODE:-netns} BENCH_RATE=${BENCH_RATE:-200mbit}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
run_env="PYTHONPATH=plugins/pytorch OMP_NUM_THREADS=1"

job() { # model method order: the rank command line
	local flag=""
	[[ $2 == hook ]] && flag="--oktopk"
	case $1 in
	vgg16) echo "$run_env $FW_PY examples/frameworks/vgg16_fashion.py --steps $STEPS --batch-size 4 --every-rank $flag" ;;
	bert) echo "$run_env $FW_PY examples/frameworks/hf_trainer.py --out $OUT/bert-$2-$3 --steps $STEPS --save-steps 100000 --grad-accum 1 \
--hidden $HIDDEN --layers $LAYERS --step-times $flag" ;;
	*) echo "unknown model $1" >&2; exit 2 ;;
	esac
}

for order in plain-first hook-first; do
	methods="plain hook"
	[[ $order == hook-first ]] && methods="hook plain"
	for model in $MODELS; do
		for method in $methods; do
			name=$OUT/$model-$method-$order
			rm -f "$name".out "$name".out.r*.log
			echo "== $model, $method ($order): $P ranks, $BENCH_MODE ${BENCH_RATE}" >&2
			bench/cluster.sh "$P" "$name.out" "$(job "$model" "$method" "$order")"
		done
	done
done
"$FW_PY" bench/frameworks_report.py "$OUT" | tee "$OUT/report.md"
