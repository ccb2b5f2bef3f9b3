#!/usr/bin/env bash
# make bench-e2e (and the end of make bench with BENCH_E2E=1): time to
# accuracy. bench/ddp_e2e.py trains the same model from the same seed and
# data with every method (plain DDP, fp16_compress_hook, powerSGD_hook rank
# 1 and 4, oktopk_hook as a user gets it, with algorithm="auto", and with a
# density schedule), one after the other on the same emulated cluster
# (bench/cluster.sh), evaluating on rank 0 outside the timed region; then
# bench/tta_report.py writes OUTDIR/tta.csv (a row per method),
# OUTDIR/tta_curve.csv (accuracy at every evaluation), a table appended to
# OUTDIR/bench.md (replacing an earlier one) and, with BENCH_PLOT=1,
# OUTDIR/tta.png (accuracy against training seconds, bench/plot.py).
#
#   bench/ddp_e2e.sh PYTHON OUTDIR
#
# Knobs (environment):
#   BENCH_MODE=netns|loopback BENCH_RATE=200mbit   the cluster (bench/cluster.sh)
#   BENCH_E2E_P=8                ranks
#   BENCH_E2E_STEPS=100          step budget of every method
#   BENCH_E2E_TARGET=95          held-out accuracy, percent
#   BENCH_E2E_EVAL=5             evaluate every this many steps
#   BENCH_E2E_STOP=0             1: stop each method at its target
#   BENCH_E2E_MODEL=mlp BENCH_E2E_WIDTH=   (mlp: 4096; cnn: 13; fashion: 512)
#   BENCH_E2E_DENSITY=0.01       oktopk's density
#   BENCH_E2E_POWERSGD_START=10  powerSGD's dense warm-up steps
#   BENCH_E2E_SCHED_STEPS=50     oktopk_sched's decay steps
#   BENCH_E2E_METHODS="ddp fp16 powersgd1 powersgd4 oktopk oktopk_auto oktopk_sched oktopk_w10 oktopk_w25"
#                                (oktopk_wN: N dense warm-up steps)
#   BENCH_E2E_LR=                the peak learning rate (--lr; default: the model's, charlm 0.002)
#   BENCH_E2E_SEED=0             the seed of initialization and data (--seed)
#   BENCH_E2E_ARGS=              more bench/ddp_e2e.py arguments (--lr, --batch-size, --seed)
#   BENCH_E2E_STRICT=0           1: every field must be a number (the smoke run)
#   BENCH_E2E_TOGETHER=0         1: every method in the same processes (the smoke run)
#   BENCH_E2E_NAME=tta           the output files' stem (NAME.csv, NAME_curve.csv, NAME.png)
#                                and bench.md section; make bench-text uses "text"
#   BENCH_PLOT=1 BENCH_LOGS=build/bench-logs
set -euo pipefail
PY=$1 OUTDIR=$2
HERE=$(cd "$(dirname "$0")" && pwd)
P=${BENCH_E2E_P:-8}
STEPS=${BENCH_E2E_STEPS:-100}
TARGET=${BENCH_E2E_TARGET:-95}
EVAL=${BENCH_E2E_EVAL:-5}
MODEL=${BENCH_E2E_MODEL:-mlp}
METHODS=${BENCH_E2E_METHODS:-"ddp fp16 powersgd1 powersgd4 oktopk oktopk_auto oktopk_sched oktopk_w10 oktopk_w25"}
LOGS=${BENCH_LOGS:-build/bench-logs}
NAME=${BENCH_E2E_NAME:-tta}
ARGS=(--model "$MODEL" --steps "$STEPS" --target "$TARGET" --eval-every "$EVAL"
	--density "${BENCH_E2E_DENSITY:-0.01}" --powersgd-start "${BENCH_E2E_POWERSGD_START:-10}"
	--sched-steps "${BENCH_E2E_SCHED_STEPS:-50}")
[[ -n ${BENCH_E2E_WIDTH:-} ]] && ARGS+=(--width "$BENCH_E2E_WIDTH")
[[ ${BENCH_E2E_STOP:-0} == 1 ]] && ARGS+=(--stop-at-target)
[[ -n ${BENCH_E2E_LR:-} ]] && ARGS+=(--lr "$BENCH_E2E_LR")
[[ -n ${BENCH_E2E_SEED:-} ]] && ARGS+=(--seed "$BENCH_E2E_SEED")
mkdir -p "$OUTDIR" "$LOGS"
rows=$LOGS/$NAME-P$P.out
rm -f "$rows"
# Each method in fresh processes; BENCH_E2E_TOGETHER=1 runs them all in
# one job, one after the other in the same processes, which saves an
# interpreter start (seconds of torch import per rank) per method.
run_methods=($METHODS)
if [[ ${BENCH_E2E_TOGETHER:-0} == 1 ]]; then
	joined=$(echo $METHODS) # one space between names
	run_methods=("${joined// /,}")
fi
jobs=()
for method in "${run_methods[@]}"; do
	jobs+=("PYTHONPATH='$HERE/../plugins/pytorch' '$PY' '$HERE/ddp_e2e.py' --method $method ${ARGS[*]} ${BENCH_E2E_ARGS:-}")
done
echo "time to accuracy: P=$P, $MODEL, methods: $METHODS; $STEPS steps, target $TARGET, evaluated every $EVAL (${BENCH_MODE:-netns}, ${BENCH_RATE:-200mbit})" >&2
START=$SECONDS
CHILD=
trap '[[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null; exit 143' INT TERM
"$HERE/cluster.sh" "$P" "$rows" "${jobs[@]}" &
CHILD=$!
wait "$CHILD"
CHILD=
strict=()
[[ ${BENCH_E2E_STRICT:-0} == 1 ]] && strict=(--strict)
BENCH_MODE=${BENCH_MODE:-netns} BENCH_RATE=${BENCH_RATE:-200mbit} \
	"$PY" "$HERE/tta_report.py" "${strict[@]}" --sched-steps "${BENCH_E2E_SCHED_STEPS:-50}" --name "$NAME" --methods "$METHODS" "$rows" "$OUTDIR"
if [[ ${BENCH_PLOT:-1} == 1 ]]; then
	# A language model's target is a loss: its curves are losses.
	kind=--tta
	[[ $MODEL == charlm ]] && kind=--tta-loss
	"$PY" "$HERE/plot.py" $kind "$OUTDIR/${NAME}_curve.csv" "$OUTDIR/$NAME.png" "$TARGET"
fi
echo "time to accuracy: $((SECONDS - START)) s" >&2
