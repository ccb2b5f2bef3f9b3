#!/usr/bin/env bash
# The end-to-end rows: bench/ddp_e2e.py with every hook, one after the other
# on the same emulated cluster (bench/cluster.sh), written to OUTDIR/e2e.csv
# and appended to OUTDIR/bench.md.
#
#   BENCH_E2E_P=8 BENCH_E2E_STEPS=12 bench/ddp_e2e.sh PYTHON OUTDIR
set -euo pipefail
PY=$1 OUTDIR=$2
HERE=$(cd "$(dirname "$0")" && pwd)
P=${BENCH_E2E_P:-8}
STEPS=${BENCH_E2E_STEPS:-12}
ARGS=${BENCH_E2E_ARGS:-}
LOGS=${BENCH_LOGS:-build/bench-logs}
mkdir -p "$OUTDIR" "$LOGS"
CSV=$OUTDIR/e2e.csv
rows=$LOGS/e2e-P$P.csv
rm -f "$rows"
jobs=()
for hook in ddp fp16 powersgd oktopk; do
	jobs+=("PYTHONPATH='$HERE/../plugins/pytorch' '$PY' '$HERE/ddp_e2e.py' --hook $hook --steps $STEPS $ARGS")
done
echo "end to end: P=$P, ${#jobs[@]} hooks, $STEPS timed steps each (${BENCH_MODE:-netns}, ${BENCH_RATE:-200mbit})" >&2
CHILD=
trap '[[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null; exit 143' INT TERM
"$HERE/cluster.sh" "$P" "$rows" "${jobs[@]}" &
CHILD=$!
wait "$CHILD"
CHILD=
{
	echo "hook,P,params,density,steps,batch_per_rank,it_per_s,ms_per_step,accuracy,loss"
	grep -h '^[a-z0-9]*,' "$rows"
} >"$CSV"
if [[ $(($(wc -l <"$CSV") - 1)) != "${#jobs[@]}" ]]; then
	echo "ddp_e2e.sh: fewer rows than hooks (logs: $rows.r*.log)" >&2
	exit 1
fi
awk -F, -v mode="${BENCH_MODE:-netns}" -v rate="${BENCH_RATE:-200mbit}" '
NR == 1 { next }
NR == 2 {
	printf "\n## End to end: DDP training, P = %s, %s (%s)\n\n", $2, mode, rate
	printf "The VGG-style CNN of examples/pytorch/cnn.py at %s parameters, %s steps of %s images per rank (the first 3 untimed), SGD lr 0.1, momentum 0.9, same seed for every hook (bench/ddp_e2e.py).\n\n", $3, $5, $6
	print "| hook | iterations/s | ms per step | × plain DDP | test accuracy % | last loss |"
	print "|---|---|---|---|---|---|"
}
NR >= 2 { if ($1 == "ddp") base = $7; rows[NR] = $0 }
END {
	for (i = 2; i <= NR; i++) {
		split(rows[i], f, ",")
		name = f[1] == "ddp" ? "plain DDP (gloo allreduce)" : f[1] == "fp16" ? "fp16_compress_hook" : f[1] == "powersgd" ? "powerSGD_hook (rank 1)" : "oktopk_hook (density " f[4] ")"
		printf "| %s | %s | %s | %.1f | %s | %s |\n", name, f[7], f[8], f[7] / base, f[9], f[10]
	}
}' "$CSV" >>"$OUTDIR/bench.md"
echo "wrote $CSV" >&2
