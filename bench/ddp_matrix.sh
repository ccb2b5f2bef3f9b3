#!/usr/bin/env bash
# make bench-ddp: the training step of plain DDP against the oktopk hook with
# its defaults (and fixed sparse algorithms), over models × links × ranks,
# each configuration repeated with the methods in a shuffled order
# (bench/ddp_step.py times every rank's steps); then bench/ddp_matrix.py
# writes OUTDIR/ddp_matrix.csv (every repeat), OUTDIR/ddp_matrix.md (medians
# of the repeats, with the spread) and a section of OUTDIR/bench.md.
#
#   bench/ddp_matrix.sh PYTHON OUTDIR
#
# Knobs (environment):
#   BENCH_DDP_LINKS="loopback 1gbit 200mbit"   links (loopback needs no root)
#   BENCH_DDP_MODELS="cnn:1 mlp:2176 mlp:4096"  model:width (0.1M, 5.0M, 17.1M parameters)
#   BENCH_DDP_P=4 BENCH_DDP_P8_LINKS=200mbit    ranks, and the links also run at 8 ranks
#   BENCH_DDP_REPS=3 BENCH_DDP_STEPS=60 BENCH_DDP_SKIP=32
#                                steps per method, and how many of the first
#                                are left out of the median (the default
#                                hook's first decision and its confirmation)
#   BENCH_DDP_METHODS="ddp allreduce_hook oktopk oktopk_oktopk oktopk_topka"
#                                (allreduce_hook, torch's own hook, is left out
#                                at 200mbit, where a dense step takes seconds)
#   BENCH_DDP_REP_FIRST=1        the first repeat's number (to add repeats)
#   BENCH_DDP_APPEND=0           1: add to the rows of an earlier run instead
#                                of starting afresh
#   BENCH_LOGS=build/bench-logs
# A job that fails (a rank crashed) is reported and the matrix goes on; the
# rows it printed before count.
set -euo pipefail
PY=$1 OUTDIR=$2
HERE=$(cd "$(dirname "$0")" && pwd)
LINKS=${BENCH_DDP_LINKS-"loopback 1gbit 200mbit"}
MODELS=${BENCH_DDP_MODELS:-"cnn:1 mlp:2176 mlp:4096"}
P=${BENCH_DDP_P:-4}
P8_LINKS=${BENCH_DDP_P8_LINKS-200mbit}
REPS=${BENCH_DDP_REPS:-3}
STEPS=${BENCH_DDP_STEPS:-60}
SKIP=${BENCH_DDP_SKIP:-32}
METHODS=${BENCH_DDP_METHODS:-"ddp allreduce_hook oktopk oktopk_oktopk oktopk_topka"}
LOGS=${BENCH_LOGS:-build/bench-logs}
mkdir -p "$OUTDIR" "$LOGS"
rows=$LOGS/ddp_matrix.out
[[ ${BENCH_DDP_APPEND:-0} == 1 ]] || rm -f "$rows"
FIRST=${BENCH_DDP_REP_FIRST:-1}
configs=()
for link in $LINKS; do configs+=("$P:$link"); done
for link in $P8_LINKS; do configs+=("8:$link"); done
START=$SECONDS
for config in "${configs[@]}"; do
	ranks=${config%%:*} link=${config#*:}
	mode=netns
	[[ $link == loopback ]] && mode=loopback
	for rep in $(seq "$FIRST" $((FIRST + REPS - 1))); do
		jobs=()
		for model in $MODELS; do
			# The methods' order, shuffled per repeat and model (seeded: the
			# same run gives the same orders).
			methods=$METHODS
			[[ $link == 200mbit ]] && methods=$(echo $METHODS | tr ' ' '\n' | grep -vx allreduce_hook | paste -sd' ')
			order=$(echo $methods | tr ' ' '\n' | shuf --random-source=<(yes "$rep$model$link$ranks") | paste -sd,)
			jobs+=("PYTHONPATH='$HERE/../plugins/pytorch' '$PY' '$HERE/ddp_step.py' --model ${model%%:*} --width ${model#*:} --order $order --steps $STEPS --skip $SKIP --link $link --rep $rep")
		done
		echo "ddp step matrix: P=$ranks, $link, repeat $rep ($FIRST to $((FIRST + REPS - 1))) ($((SECONDS - START)) s so far)" >&2
		for job in "${jobs[@]}"; do
			BENCH_MODE=$mode BENCH_RATE=$link "$HERE/cluster.sh" "$ranks" "$rows" "$job" ||
				echo "ddp step matrix: a job failed (its rows so far are kept): $job" >&2
		done
	done
done
"$PY" "$HERE/ddp_matrix.py" "$rows" "$OUTDIR"
