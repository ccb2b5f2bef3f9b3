#!/usr/bin/env bash
# make bench: every algorithm and torch.distributed's gloo allreduce, side by
# side, on an emulated cluster (bench/cluster.sh), for every configuration
# of P × n × density, BENCH_REPS times each in an order shuffled anew for
# every configuration and repetition (seeded: BENCH_SEED), so that no
# algorithm always runs first on a fresh cluster or right after another.
# Writes OUTDIR/bench_runs.csv (a row per repetition), OUTDIR/bench.csv (a
# row per configuration and algorithm: medians over the repetitions, with
# their spread; bench/aggregate.py) and OUTDIR/bench.md (OUTDIR: results by
# default), then the plots (bench/plot.py) and, with BENCH_E2E=1, time to
# accuracy under DDP (bench/ddp_e2e.sh, make bench-e2e).
#
#   bench/run.sh BENCHRANK PYTHON [OUTDIR]
#
# Knobs (environment):
#   BENCH_P="2 4 8 16" BENCH_N="4194304 16777216" BENCH_DENSITY="0.01 0.001"
#   BENCH_CONFIGS="P:n:density ..."  an explicit list instead of the product
#   BENCH_RATE=200mbit BENCH_MODE=netns|loopback
#   BENCH_REPS=3 BENCH_SEED=1        repetitions; the order's seed
#   BENCH_ITERS=20 BENCH_WARMUP=3    timed and untimed calls, sparse algorithms
#   BENCH_DENSE_ITERS=5              timed calls of the dense ones (and gloo)
#   BENCH_TAU=16 BENCH_TAU_PRIME=8   Ok-Topk's periods; warmup+iters > τ
#   BENCH_ALGS="oktopk topka ..."    default: every algorithm, then gloo
#   BENCH_APPEND=1                   keep OUTDIR's other configurations' rows
#                                    (measured with the same BENCH_REPS)
#   BENCH_PLOT=1 BENCH_E2E=0         plots; time to accuracy (bench/ddp_e2e.sh's knobs)
#   BENCH_LOGS=build/bench-logs      every rank's output
#   BENCH_TRACE=1                    rank 0 logs every call (time, words, counts)
set -euo pipefail
BENCHRANK=$1 PY=$2 OUTDIR=${3:-results}
RATE=${BENCH_RATE:-200mbit}
MODE=${BENCH_MODE:-netns}
ITERS=${BENCH_ITERS:-20} WARMUP=${BENCH_WARMUP:-3} DENSE_ITERS=${BENCH_DENSE_ITERS:-5}
TAU=${BENCH_TAU:-16} TAU_PRIME=${BENCH_TAU_PRIME:-8}
REPS=${BENCH_REPS:-3} SEED=${BENCH_SEED:-1}
LOGS=${BENCH_LOGS:-build/bench-logs}
ALGS=${BENCH_ALGS:-"$("$BENCHRANK" -list | tr '\n' ' ') torch_gloo_allreduce"}
HERE=$(cd "$(dirname "$0")" && pwd)

if ! [[ $REPS =~ ^[1-9][0-9]*$ && $SEED =~ ^[0-9]+$ ]]; then
	echo "run.sh: BENCH_REPS ($REPS) must be a positive integer, BENCH_SEED ($SEED) a non-negative one" >&2
	exit 2
fi
if ((WARMUP + ITERS <= TAU)); then
	echo "run.sh: warmup+iters ($((WARMUP + ITERS))) must exceed τ ($TAU) so refreshes are measured" >&2
	exit 2
fi

# tbf's rate units, in bit/s, for the lower-bound time; loopback has none.
rate_bps() {
	[[ $MODE == loopback ]] && { echo 0; return; }
	local num=${RATE%%[a-z]*} unit=${RATE##*[0-9.]}
	case $unit in
	kbit) echo "$num * 1000" | bc ;; mbit) echo "$num * 1000000" | bc ;;
	gbit) echo "$num * 1000000000" | bc ;; bit | "") echo "$num" ;;
	*) echo "run.sh: rate unit $unit not understood (use kbit, mbit or gbit)" >&2; exit 2 ;;
	esac
}
BPS=$(rate_bps)

CONFIGS=()
if [[ -n ${BENCH_CONFIGS:-} ]]; then
	read -ra CONFIGS <<<"$BENCH_CONFIGS"
else
	for n in ${BENCH_N:-4194304 16777216}; do
		for d in ${BENCH_DENSITY:-0.01 0.001}; do
			for p in ${BENCH_P:-2 4 8 16}; do CONFIGS+=("$p:$n:$d"); done
		done
	done
fi

mkdir -p "$OUTDIR" "$LOGS"
RUNS=$OUTDIR/bench_runs.csv CSV=$OUTDIR/bench.csv
# Auto's start-up link measurement and its choices, per configuration and
# repetition, from the ranks' logs (rank 0 prints them): kept for the
# configurations not measured again under BENCH_APPEND=1, like the CSV.
AUTO=$OUTDIR/auto.txt
HEADER=$("$BENCHRANK" -print-header)
if [[ ${BENCH_APPEND:-0} == 1 && -f $RUNS && $(head -n 1 "$RUNS") == "$HEADER" ]]; then
	# Drop the rows of the configurations about to be measured again.
	keep=$(mktemp)
	awk -F, -v cfgs="${CONFIGS[*]}" 'BEGIN { n = split(cfgs, c, " "); for (i = 1; i <= n; i++) skip[c[i]] = 1 }
		NR > 1 && !(($2 ":" $3 ":" $4) in skip)' "$RUNS" >"$keep"
	{ echo "$HEADER"; cat "$keep"; } >"$RUNS"
	rm -f "$keep"
	if [[ -f $AUTO ]]; then
		keep=$(mktemp)
		awk -v cfgs="${CONFIGS[*]}" 'BEGIN { n = split(cfgs, c, " "); for (i = 1; i <= n; i++) skip[c[i]] = 1 }
			!($1 in skip)' "$AUTO" >"$keep"
		mv "$keep" "$AUTO"
	fi
else
	echo "$HEADER" >"$RUNS"
	rm -f "$AUTO"
fi

# shuffled SEED WORD...: the words in an order drawn from SEED.
source "$HERE/shuffled.sh"

CHILD=
stop() { [[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null; exit "$1"; }
trap 'stop 130' INT
trap 'stop 143' TERM
in_cluster() { # P OUT JOB...: bench/cluster.sh in the background, so a signal reaches it
	"$HERE/cluster.sh" "$@" &
	CHILD=$!
	local rc=0
	wait "$CHILD" || rc=$?
	CHILD=
	return $rc
}

START=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)); }
i=0
for cfg in "${CONFIGS[@]}"; do
	IFS=: read -r P N D <<<"$cfg"
	i=$((i + 1))
	echo "[$i/${#CONFIGS[@]}] P=$P n=$N density=$D rate=$RATE ($MODE), elapsed $(elapsed)" >&2
	jobs=()
	for ((rep = 1; rep <= REPS; rep++)); do
		order=$(shuffled $((SEED * 1000003 + i * 1009 + rep)) $ALGS)
		echo "  repetition $rep: $order" >&2
		pos=0
		for alg in $order; do
			pos=$((pos + 1))
			case $alg in
			torch_gloo_allreduce)
				jobs+=("'$PY' '$HERE/gloo_allreduce.py' --n $N --density $D --iters $DENSE_ITERS --warmup 1 --rate-bps $BPS --rep $rep --position $pos") ;;
			dense_*)
				jobs+=("'$BENCHRANK' -algs $alg -n $N -density $D -iters $DENSE_ITERS -warmup 1 -tau $TAU -tau-prime $TAU_PRIME -rate-bps $BPS -rep $rep -position $pos") ;;
			*)
				jobs+=("'$BENCHRANK' -algs $alg -n $N -density $D -iters $ITERS -warmup $WARMUP -tau $TAU -tau-prime $TAU_PRIME -rate-bps $BPS -rep $rep -position $pos") ;;
			esac
		done
	done
	rows=$LOGS/P$P-n$N-d$D.csv
	rm -f "$rows"
	BENCH_MODE=$MODE BENCH_RATE=$RATE in_cluster "$P" "$rows" "${jobs[@]}"
	grep -h '^[a-z_]*,' "$rows" >>"$RUNS"
	for log in "$rows".r*.log; do
		grep -h "^benchrank: auto" "$log" 2>/dev/null | sed "s/^benchrank: /$cfg /" >>"$AUTO" || true
	done
	if [[ $(grep -c '^[a-z_]*,' "$rows") != $((REPS * $(wc -w <<<"$ALGS"))) ]]; then
		echo "run.sh: P=$P n=$N density=$D: fewer rows than algorithms × repetitions (logs: $LOGS)" >&2
		exit 1
	fi
done
echo "measured ${#CONFIGS[@]} configurations in $(elapsed)" >&2

"$PY" "$HERE/aggregate.py" --reps "$REPS" "$RUNS" >"$CSV"
"$HERE/check_csv.sh" "$CSV" $ALGS
BENCH_MODE=$MODE BENCH_RATE=$RATE BENCH_ITERS=$ITERS BENCH_WARMUP=$WARMUP BENCH_DENSE_ITERS=$DENSE_ITERS \
	BENCH_TAU=$TAU BENCH_TAU_PRIME=$TAU_PRIME BENCH_REPS=$REPS BENCH_SEED=$SEED BENCH_AUTO=$AUTO "$HERE/report.sh" "$CSV" >"$OUTDIR/bench.md"
if [[ -s $AUTO ]]; then
	{
		printf '\n## Auto: its link measurement and its choices\n\n'
		echo "Rank 0's log of every \`auto\` job (P:n:density first): the start-up link measurement, timed after a barrier, and every call whose choice differed from the call before."
		echo
		sed 's/^/    /' "$AUTO"
	} >>"$OUTDIR/bench.md"
fi

if [[ ${BENCH_PLOT:-1} == 1 ]]; then
	"$PY" "$HERE/plot.py" "$CSV" "$OUTDIR"
fi
if [[ ${BENCH_E2E:-0} == 1 ]]; then
	BENCH_MODE=$MODE BENCH_RATE=$RATE "$HERE/ddp_e2e.sh" "$PY" "$OUTDIR"
fi
echo "wrote $OUTDIR/bench_runs.csv, $OUTDIR/bench.csv and $OUTDIR/bench.md ($(elapsed))" >&2
