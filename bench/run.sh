#!/usr/bin/env bash
# make bench: every algorithm and torch.distributed's gloo allreduce, side by
# side, on an emulated cluster (bench/cluster.sh), for each P. Writes
# results/bench.csv and results/bench.md.
#
#   BENCH_P="2 4 8" BENCH_N=4194304 BENCH_DENSITY=0.01 BENCH_RATE=200mbit bench/run.sh BENCHRANK PYTHON
set -euo pipefail
BENCHRANK=$1 PY=$2
PS=${BENCH_P:-"2 4 8"}
N=${BENCH_N:-4194304}
DENSITY=${BENCH_DENSITY:-0.01}
RATE=${BENCH_RATE:-200mbit}
MODE=${BENCH_MODE:-netns}
mkdir -p results
CSV=results/bench.csv
echo "algorithm,P,n,density,k,median_ms,min_ms,max_ms,select_ms,words_per_rank,formula_words,lower_bound_words,words_over_lower_bound,global_selected,peak_rss_mib" >"$CSV"
for P in $PS; do
	echo "== P=$P n=$N density=$DENSITY rate=$RATE ($MODE)" >&2
	bench/cluster.sh "$P" "$N" "$DENSITY" "$RATE" "$CSV" "$BENCHRANK" "$PY" "$MODE"
done
{
	echo "Emulated cluster: $MODE, each rank's egress limited to $RATE; n = $N float32, density $DENSITY."
	echo "All ranks share this machine's $(nproc) CPU cores, so selection and reduction time is inflated at large P."
	echo "Command: make bench (BENCH_P=\"$PS\" BENCH_N=$N BENCH_DENSITY=$DENSITY BENCH_RATE=$RATE), $(date -u +%Y-%m-%d)."
	echo
	echo "| algorithm | P | median ms (min–max) | selection ms | words per rank | formula | × lower bound 2k(P−1)/P | global entries (k) |"
	echo "|---|---|---|---|---|---|---|---|"
	tail -n +2 "$CSV" | awk -F, '{printf "| %s | %s | %s (%s–%s) | %s | %s | %s | %s | %s (%s) |\n", $1, $2, $6, $7, $8, $9, $10, $11, $13, $14, $5}'
} >results/bench.md
cat results/bench.md
