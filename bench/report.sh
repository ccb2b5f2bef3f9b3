#!/usr/bin/env bash
# The markdown report of bench/run.sh's CSV: how it was measured, then one
# table per configuration (P, n, density) in the CSV's order.
#
#   BENCH_MODE=... BENCH_RATE=... BENCH_ITERS=... bench/report.sh CSV >bench.md
set -euo pipefail
CSV=$1
MODE=${BENCH_MODE:-netns} RATE=${BENCH_RATE:-200mbit}
if [[ -n ${BENCH_CONFIGS:-} ]]; then
	CMD="make bench BENCH_CONFIGS=\"$BENCH_CONFIGS\""
else
	CMD="make bench BENCH_P=\"${BENCH_P:-2 4 8 16}\" BENCH_N=\"${BENCH_N:-4194304 16777216}\" BENCH_DENSITY=\"${BENCH_DENSITY:-0.01 0.001}\""
fi
cat <<HEAD
# Benchmark: sparse allreduce on an emulated cluster

Measured $(date -u +%Y-%m-%d) by \`$CMD\` (bench/run.sh). Mode: $MODE$([[ $MODE == netns ]] && echo ", one network namespace per rank on a bridge, each rank's egress limited to $RATE by tc tbf")$([[ $MODE == loopback ]] && echo ", 127.0.0.1, no rate limit").
All ranks share this machine's $(nproc) CPU cores, so selection and reduction time grows with P.

- Workload (bench/cmd/benchrank): drifting synthetic gradients, a shared signal s_t = 0.9·s_{t−1} + 0.44·σ_i·ε plus 0.5·σ_i·ε_r per rank, σ_i log-normal.
- Sparse algorithms: ${BENCH_WARMUP:-3} untimed + ${BENCH_ITERS:-20} timed calls, τ′ = ${BENCH_TAU_PRIME:-8}, τ = ${BENCH_TAU:-16} (so exact-threshold refreshes and repartitions happen inside the timed calls); dense ones and gloo: 1 + ${BENCH_DENSE_ITERS:-5}. One job per algorithm (its own processes), so peak RSS is that algorithm's.
- *median (min–max)*: wall time of one call on rank 0 after a barrier; *select* / *comm*: selection time and the rest (total − select), medians.
- *words*: 4-byte words sent per rank per call (index and value one word each), mean over ranks; *reuse mean*: averaged over the calls that neither refresh thresholds (c mod τ′ ≠ 0) nor repartition (c mod τ ≠ 0); *median*: over all timed calls. Gloo's words are its formula, not measured.
- *× LB*: reuse-mean words ÷ the lower bound 2k(P−1)/P (2n(P−1)/P for dense); *LB ms*: that bound's time on the link (bandwidth term only).
- *rel. error*: ‖out − ref‖/‖ref‖, ref the exact top-k of the sum over ranks of each rank's accumulator (gradient + residual) on the last call, ÷P (the exact sum for dense algorithms); all ranks' accumulators summed by an untimed dense allreduce.
- *peak RSS*: max over ranks of VmHWM during the algorithm's calls (MiB; includes the workload's 3n floats, *base* is the RSS before the calls).
HEAD
awk -F, '
NR == FNR { if (FNR > 1 && $1 == "torch_gloo_allreduce") gloo[$2 SUBSEP $3 SUBSEP $4] = $7; next }
FNR == 1 { next }
{
	cfg = $2 SUBSEP $3 SUBSEP $4
	if (cfg != last) {
		printf "\n### P = %s, n = %s, density %s (k = %s)\n\n", $2, $3, $4, $5
		print "| algorithm | median ms (min–max) | × faster than gloo | select ms | comm ms | words reuse mean (median) | formula | × LB | LB ms | global entries | rel. error | peak RSS MiB (base) |"
		print "|---|---|---|---|---|---|---|---|---|---|---|---|"
		last = cfg
	}
	speed = (cfg in gloo) ? sprintf("%.1f", gloo[cfg] / $7) : "–"
	printf "| %s | %s (%s–%s) | %s | %s | %s | %s (%s) | %s | %s | %s | %s | %s | %s (%s) |\n", \
		$1, $7, $8, $9, speed, $10, $11, $14, $12, $15, $17, $18, $19, $20, $21, $22
}' "$CSV" "$CSV"
