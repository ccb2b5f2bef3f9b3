#!/usr/bin/env bash
# make demo: plain DDP against the oktopk hook with its defaults, the same
# training from the same seed, on 4 ranks, each run stopping at its first
# evaluation at or above DEMO_TARGET (the question a user asks: how soon is
# the model trained). As root, each rank runs in its own network namespace
# with its link limited to DEMO_RATE (bench/cluster.sh), a slow link where
# communication is most of a dense step; otherwise on loopback, a fast link,
# where the hook's measured choice keeps the framework's allreduce.
# bench/demo_report.py prints both side by side (ms and bytes per step, time
# to the target, final accuracy, what the hook chose and why) and saves
# OUTDIR/demo.png, accuracy against training seconds.
#
#   bench/demo.sh PYTHON OUTDIR
#
# Knobs: DEMO_MODE=netns|loopback (default: netns as root, else loopback)
#        DEMO_RATE=200mbit DEMO_RANKS=4 DEMO_STEPS=100 DEMO_TARGET=95
#        DEMO_WIDTH=2048 (the wide MLP of bench/ddp_e2e.py: 4.3M parameters;
#        4096: 17.1M, the step matrix's)
#        DEMO_STOP=1 (0: every run takes all DEMO_STEPS)
set -euo pipefail
PY=$1 OUTDIR=$2
HERE=$(cd "$(dirname "$0")" && pwd)
RATE=${DEMO_RATE:-200mbit} P=${DEMO_RANKS:-4} STEPS=${DEMO_STEPS:-100} TARGET=${DEMO_TARGET:-95}
MODE=${DEMO_MODE:-}
if [[ -z $MODE ]]; then
	MODE=loopback
	if [[ $EUID == 0 ]] && command -v ip >/dev/null && command -v tc >/dev/null && ip netns add okdemo-probe-$$ 2>/dev/null; then
		ip netns del okdemo-probe-$$
		MODE=netns
	fi
fi
mkdir -p "$OUTDIR"
rows=$OUTDIR/demo.out
rm -f "$rows" "$rows".r*.log
link="loopback (a fast link, no limit)"
[[ $MODE == netns ]] && link="$RATE per rank (network namespaces, tc)"
WIDTH=${DEMO_WIDTH:-2048}
stop=""
[[ ${DEMO_STOP:-1} == 1 ]] && stop="--stop-at-target"
echo "== plain DDP, then the oktopk hook with its defaults: $P ranks, an MLP of width $WIDTH on the digits, until $TARGET% held-out accuracy or $STEPS steps, $link"
BENCH_MODE=$MODE BENCH_RATE=$RATE "$HERE/cluster.sh" "$P" "$rows" \
	"PYTHONPATH='$HERE/../plugins/pytorch' '$PY' '$HERE/ddp_e2e.py' --method ddp,oktopk --model mlp --width $WIDTH --steps $STEPS --target $TARGET --eval-every 5 $stop"
"$PY" "$HERE/demo_report.py" "$rows" "$OUTDIR" "$MODE" "$RATE" "$TARGET"
