#!/usr/bin/env bash
# An emulated cluster on one machine: P network namespaces on a bridge, one
# veth per rank, each rank's egress limited by a token bucket (tc tbf), so
# the network is the bottleneck as on a real cluster. Runs benchrank (every
# oktopk algorithm) and torch.distributed's gloo allreduce on it and appends
# their CSV rows to OUT. Everything it creates is named oktb-* and removed
# on exit, even when interrupted; leftovers of an interrupted run are
# removed first.
#
#   bench/cluster.sh P N DENSITY RATE OUT BENCHRANK PYTHON [loopback]
#
# Addresses come from 198.18.0.0/24 (the range set aside for benchmarks),
# on this machine's own namespaces only. Run as root.
set -euo pipefail
P=$1 N=$2 DENSITY=$3 RATE=$4 OUT=$5 BENCHRANK=$6 PY=$7 MODE=${8:-netns}
ITERS=${BENCH_ITERS:-12}
PORT=$((29000 + RANDOM % 2000))

cleanup() {
	for ns in $(ip netns list 2>/dev/null | awk '/^oktb-/{print $1}'); do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
		ip netns del "$ns" 2>/dev/null || true
	done
	ip link del oktb-br 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup

run_ranks() { # command... ; runs one copy per rank, in its namespace
	local pids=() r
	for ((r = 0; r < P; r++)); do
		local env=(RANK=$r LOCAL_RANK=$r WORLD_SIZE=$P MASTER_PORT=$PORT OMP_NUM_THREADS=1)
		if [[ $MODE == netns ]]; then
			ip netns exec oktb-r$r env "${env[@]}" MASTER_ADDR=198.18.0.1 \
				OKTOPK_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 "$@" >>"$OUT.r$r" 2>&1 &
		else
			env "${env[@]}" MASTER_ADDR=127.0.0.1 "$@" >>"$OUT.r$r" 2>&1 &
		fi
		pids+=($!)
	done
	local rc=0
	for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
	return $rc
}

if [[ $MODE == netns ]]; then
	ip link add oktb-br type bridge
	ip link set oktb-br up
	for ((r = 0; r < P; r++)); do
		ip netns add oktb-r$r
		ip link add oktb-h$r type veth peer name eth0 netns oktb-r$r
		ip link set oktb-h$r master oktb-br up
		ip netns exec oktb-r$r ip addr add 198.18.0.$((r + 1))/24 dev eth0
		ip netns exec oktb-r$r ip link set eth0 up
		ip netns exec oktb-r$r ip link set lo up
		ip netns exec oktb-r$r tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kbit latency 100ms
	done
fi

rm -f "$OUT".r*
run_ranks "$BENCHRANK" -n "$N" -density "$DENSITY" -iters "$ITERS"
PORT=$((PORT + 7))
run_ranks "$PY" bench/gloo_allreduce.py --n "$N" --iters "$ITERS"
grep -h '^[a-z_]*,' "$OUT".r0 >>"$OUT"
rm -f "$OUT".r*
