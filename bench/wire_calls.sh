#!/usr/bin/env bash
# One Ok-Topk call with coded indices and float32, 8-bit or 4-bit values,
# against the same call before indices were coded (32-bit indices, float32
# values: bench/cmd/benchrank built at that commit) and against gloo's
# dense allreduce, on the emulated cluster (bench/cluster.sh). Each
# repetition runs every variant once, in an order shuffled anew (seeded), so
# none always runs first or after another. Prints a table of the
# repetitions' medians (each a median over its timed calls, the call timed
# from the first rank's start to the last rank's end) and writes every
# repetition's row, the variant first, to OUT.
#
#   bench/wire_calls.sh BENCHRANK BENCHRANK_BEFORE PYTHON OUT.csv
#
# Knobs: WIRE_P=8 WIRE_N=16777216 WIRE_DENSITY=0.01 WIRE_REPS=3 WIRE_SEED=1
# WIRE_ITERS=20 WIRE_WARMUP=3 WIRE_DENSE_ITERS=3, and cluster.sh's
# BENCH_MODE and BENCH_RATE (200mbit).
set -euo pipefail
NOW=$1 BEFORE=$2 PY=$3 OUT=$4
P=${WIRE_P:-8} N=${WIRE_N:-16777216} D=${WIRE_DENSITY:-0.01}
REPS=${WIRE_REPS:-3} SEED=${WIRE_SEED:-1}
ITERS=${WIRE_ITERS:-20} WARMUP=${WIRE_WARMUP:-3} DENSE_ITERS=${WIRE_DENSE_ITERS:-3}
RATE=${BENCH_RATE:-200mbit}
HERE=$(cd "$(dirname "$0")" && pwd)
case $RATE in
*mbit) BPS=$((${RATE%mbit} * 1000000)) ;;
*gbit) BPS=$((${RATE%gbit} * 1000000000)) ;;
*) echo "wire_calls.sh: BENCH_RATE must be in mbit or gbit, not $RATE" >&2; exit 2 ;;
esac
[[ ${BENCH_MODE:-netns} == loopback ]] && BPS=0
VARIANTS=(before float32 int8 int4 gloo)

job() { # variant rep position: the command line each rank runs
	local sparse="-algs oktopk -n $N -density $D -iters $ITERS -warmup $WARMUP -tau 16 -tau-prime 8 -rate-bps $BPS -rep $2 -position $3"
	case $1 in
	before) echo "'$BEFORE' $sparse" ;;
	float32 | int8 | int4) echo "'$NOW' $sparse -values $1" ;;
	gloo) echo "'$PY' '$HERE/gloo_allreduce.py' --n $N --density $D --iters $DENSE_ITERS --warmup 1 --rate-bps $BPS --rep $2 --position $3" ;;
	esac
}

# shuffled SEED WORD...: the words in an order drawn from SEED.
source "$HERE/shuffled.sh"

jobs=() names=()
for ((rep = 1; rep <= REPS; rep++)); do
	order=$(shuffled $((SEED * 1000003 + rep)) "${VARIANTS[@]}")
	echo "repetition $rep: $order" >&2
	pos=0
	for v in $order; do
		pos=$((pos + 1))
		jobs+=("$(job "$v" "$rep" "$pos")")
		names+=("$rep:$pos:$v")
	done
done
rows=$(mktemp)
trap 'rm -f "$rows" "$rows".r*.log' EXIT
"$HERE/cluster.sh" "$P" "$rows" "${jobs[@]}"
{
	echo "variant,$("$NOW" -print-header)"
	# rep and position (columns 6 and 7) name the variant of each row.
	grep -h '^[a-z_]*,' "$rows" | awk -F, -v names="${names[*]}" '
		BEGIN { n = split(names, a, " "); for (i = 1; i <= n; i++) { split(a[i], f, ":"); v[f[1] ":" f[2]] = f[3] } }
		{ print v[$6 ":" $7] "," $0 }'
} >"$OUT"
if [[ $(($(wc -l <"$OUT") - 1)) != $((REPS * ${#VARIANTS[@]})) ]]; then
	echo "wire_calls.sh: fewer rows than variants × repetitions in $OUT" >&2
	exit 1
fi
"$PY" - "$OUT" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    by.setdefault(r["variant"], []).append(float(r["median_ms"]))
med = {v: statistics.median(ms) for v, ms in by.items()}
words = {v: statistics.median(float(r["words_reuse_mean"]) for r in rows if r["variant"] == v) for v in by}
print("| variant | repetitions' medians, ms | median ms | before ÷ it | gloo ÷ it | words per rank (reuse mean) |")
print("|---|---|---|---|---|---|")
for v in ("before", "float32", "int8", "int4", "gloo"):
    ms = ", ".join(f"{x:.1f}" for x in sorted(by[v]))
    print(f"| {v} | {ms} | {med[v]:.1f} | {med['before'] / med[v]:.2f} | {med['gloo'] / med[v]:.2f} | {words[v]:.0f} |")
EOF
