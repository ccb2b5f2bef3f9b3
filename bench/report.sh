#!/usr/bin/env bash
# The markdown report of bench/run.sh's CSV (bench/aggregate.py's: a row per
# configuration and algorithm): how it was measured, then one table per
# configuration (P, n, density) in the CSV's order. Columns are found by
# their names in the CSV's header.
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

Measured $(date -u +%Y-%m-%d) by \`$CMD\` (bench/run.sh). Mode: $MODE$([[ $MODE == netns ]] && echo ", one network namespace per rank on a bridge, each rank's link limited to $RATE in both directions by tc tbf (on either end of its veth pair; TCP segments kept below the bucket's 32 KiB, so they are shaped whole, not cut into MTU packets)")$([[ $MODE == loopback ]] && echo ", 127.0.0.1, no rate limit").
All ranks share this machine's $(nproc) CPU cores, so selection and reduction time grows with P.

- Workload (bench/cmd/benchrank): drifting synthetic gradients, a shared signal s_t = 0.9·s_{t−1} + 0.44·σ_i·ε plus 0.5·σ_i·ε_r per rank, σ_i log-normal.
- Sparse algorithms: ${BENCH_WARMUP:-3} untimed + ${BENCH_ITERS:-20} timed calls, τ′ = ${BENCH_TAU_PRIME:-8}, τ = ${BENCH_TAU:-16} (so exact-threshold refreshes and repartitions happen inside the timed calls); dense ones and gloo: 1 + ${BENCH_DENSE_ITERS:-5}. One job per algorithm (its own processes), so peak RSS is that algorithm's.
- Repetitions: every configuration ran ${BENCH_REPS:-3} times, each repetition every algorithm once, in an order shuffled anew for every configuration and repetition (seed ${BENCH_SEED:-1}; bench/run.sh prints the orders). Every number below is the median over the repetitions of that repetition's value (itself a median over its timed calls, as said for each column).
- *time ms*: how long a call lasts for a synchronous training step, which waits for the slowest rank: every call starts right after a barrier, every rank notes its start and end on the wall clock all ranks on this machine share, and the call lasts from the first rank's start to the last rank's end (the barrier's exit skew counts against the call; *skew ms* is its median). Median over the calls; *spread* is the smallest and largest of the repetitions' medians, *calls* the fastest and slowest call of any repetition. *rank 0 ms*: the call as rank 0 alone saw it, which misses whatever the other ranks still do after rank 0 returns.
- *× LB time*: time ÷ *LB ms*, the lower bound's time on the link: 2k(P−1)/P words for sparse algorithms, a dense allreduce's 2n(P−1)/P (the ring's bandwidth bound) for the dense ones and gloo.
- Phases, *ms (wire ms)*, medians over the calls: the phase's time on the rank that finished the call last (so they add up to about the call's time), and in parentheses its wire time, the most bytes any rank sent or received in it ÷ the link's rate. *select*: acc = grad + residual and the local selection (the same work in every algorithm); *agree*: the ranks' agreement on NaN/Inf; *reduce*: split-and-reduce (Ok-Topk: with the repartition), tree reduce, recursive doubling, the sum of gathered selections, a dense reduce-scatter; *global sel.*: Ok-Topk's histogram cut; *balance*: Ok-Topk's; *allgather*: allgatherv, gTopk's broadcast, a dense allgather; *output*: the result into the caller's buffer and the residual. Gloo's reduce-scatter (reduce) and allgather are not visible from outside (?); their wire times are its ring's formula.
- *words*: 4-byte words sent per rank per call (index and value one word each), mean over ranks; *reuse mean*: averaged over the calls that neither refresh thresholds (c mod τ′ ≠ 0) nor repartition (c mod τ ≠ 0); *median*: over all timed calls. Gloo's words are its formula, not measured. *× LB*: reuse-mean words ÷ the lower bound.
- *rel. error*: ‖out − ref‖/‖ref‖, ref the exact top-k of the sum over ranks of each rank's accumulator (gradient + residual) on the last call, ÷P (the exact sum for dense algorithms); all ranks' accumulators summed by an untimed dense allreduce.
- *peak RSS*: max over ranks of VmHWM during the algorithm's calls (MiB; includes the workload's 3n floats, *base* is the RSS before the calls).
HEAD
awk -F, '
function v(name) { return $(col[name]) }
function num(x) { return tolower(x) == "nan" ? "–" : x }
function ratio(a, b) { return (tolower(a) == "nan" || tolower(b) == "nan" || b + 0 == 0) ? "–" : sprintf("%.2f", a / b) }
function phase(p,   t, w) {
	t = v(p "_ms"); w = v(p "_wire_ms")
	if (tolower(t) == "nan") t = "?"
	if (t + 0 == 0 && t != "?" && (w + 0 == 0 || tolower(w) == "nan")) return "–"
	return t " (" num(w) ")"
}
FNR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
NR == FNR { if (v("algorithm") == "torch_gloo_allreduce") gloo[v("P") SUBSEP v("n") SUBSEP v("density")] = v("median_ms"); next }
{
	cfg = v("P") SUBSEP v("n") SUBSEP v("density")
	if (cfg != last) {
		printf "\n### P = %s, n = %s, density %s (k = %s)\n\n", v("P"), v("n"), v("density"), v("k")
		print "| algorithm | time ms (spread; calls) | × LB time | × faster than gloo | rank 0 ms | skew ms | select | agree | reduce | global sel. | balance | allgather | output | words reuse mean (median) | formula | × LB | LB ms | global entries | rel. error | peak RSS MiB (base) |"
		print "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
		last = cfg
	}
	speed = (cfg in gloo) ? ratio(gloo[cfg], v("median_ms")) : "–"
	printf "| %s | %s (%s–%s; %s–%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s (%s) | %s | %s | %s | %s | %s | %s (%s) |\n", \
		v("algorithm"), v("median_ms"), v("rep_min_ms"), v("rep_max_ms"), v("min_ms"), v("max_ms"), \
		ratio(v("median_ms"), v("lower_bound_ms")), speed, v("rank0_median_ms"), v("start_skew_ms"), \
		phase("select"), phase("agree"), phase("reduce"), phase("global_select"), phase("balance"), phase("allgather"), phase("output"), \
		v("words_reuse_mean"), v("words_median"), v("formula_words"), v("reuse_over_lower_bound"), num(v("lower_bound_ms")), \
		v("global_selected"), v("rel_error"), v("peak_rss_mib"), v("base_rss_mib")
}' "$CSV" "$CSV"

# Auto against the best fixed algorithm of each configuration (torch's gloo
# is not one of ours, so it is left out), with what Auto ran there
# (BENCH_AUTO: run.sh's log of Auto's choices, "P:n:density auto chose ALG ...").
if awk -F, 'NR > 1 && $1 == "auto" { found = 1 } END { exit !found }' "$CSV"; then
	printf '\n## Auto against the best fixed algorithm\n\n'
	echo "| P | n | density | auto ms | auto ran | best fixed algorithm | its ms | auto ÷ best |"
	echo "|---|---|---|---|---|---|---|---|"
	choices=$(mktemp)
	[[ -f ${BENCH_AUTO:-} ]] && awk '$2 == "auto" && $3 == "chose" { print $1 "," $4 }' "$BENCH_AUTO" >"$choices"
	awk -F, '
	FILENAME == choices { if (!(($1, $2) in had)) { had[$1, $2] = 1; ran[$1] = ran[$1] (ran[$1] == "" ? "" : ", ") $2 }; next }
	FNR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
	{
		cfg = $(col["P"]) ":" $(col["n"]) ":" $(col["density"]); alg = $(col["algorithm"]); t = $(col["median_ms"]) + 0
		if (!(cfg in seen)) { seen[cfg] = 1; order[++n] = cfg }
		if (alg == "auto") autot[cfg] = t
		else if (alg != "torch_gloo_allreduce" && (!(cfg in best) || t < best[cfg])) { best[cfg] = t; bestalg[cfg] = alg }
	}
	END {
		for (i = 1; i <= n; i++) {
			c = order[i]
			if (!(c in autot) || !(c in best)) continue
			split(c, f, ":")
			printf "| %s | %s | %s | %.2f | %s | %s | %.2f | %.2f |\n", f[1], f[2], f[3], autot[c], (c in ran ? ran[c] : "?"), bestalg[c], best[c], autot[c] / best[c]
		}
	}' choices="$choices" "$choices" "$CSV"
	rm -f "$choices"
fi
