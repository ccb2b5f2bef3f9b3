#!/usr/bin/env bash
# An emulated cluster on one machine: P network namespaces on a bridge, one
# veth per rank, each rank's link limited in both directions by a token
# bucket (tc tbf on either end of its veth pair), so the network is the
# bottleneck as on a real cluster of full-duplex links. Each JOB (one shell
# command line) runs once per rank, torchrun-style (RANK, WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT), one job after the other on the same cluster;
# rank 0's standard output is appended to OUT, every rank's output to
# OUT.r<rank>.log.
#
#   BENCH_MODE=netns|loopback BENCH_RATE=200mbit bench/cluster.sh P OUT JOB...
#
# BENCH_SHAPE=egress limits only what each rank sends (the layout before
# ingress was shaped too), for comparisons.
#
# netns mode needs root. Everything it creates is named okb<pid>-* (this
# script's process id), so concurrent runs never touch each other's
# namespaces; they and the rank processes are removed on exit, including on
# INT and TERM. Namespaces left by a run whose process is gone are removed
# first. loopback mode runs the ranks on 127.0.0.1 with no rate limit and
# needs no privileges.
#
# Addresses come from 198.18.0.0/24 (the range set aside for benchmarks),
# inside this run's own namespaces only.
set -euo pipefail
P=$1 OUT=$2
shift 2
MODE=${BENCH_MODE:-netns}
RATE=${BENCH_RATE:-200mbit}
SHAPE=${BENCH_SHAPE:-both}
# tbf's bucket (bytes) and the largest segment TCP may hand the device, kept
# below it (see the shaping below).
BURST=32768b GSO_BYTES=24576
PREFIX=okb$$
PORT=$((29000 + RANDOM % 2000))
RANK_PIDS=()

namespaces() { # the namespaces named PREFIX-r*, for the given prefix
	ip netns list 2>/dev/null | awk -v p="$1-r" 'index($1, p) == 1 {print $1}'
}

remove_run() { # prefix: kill its processes, delete its namespaces and bridge
	local ns
	for ns in $(namespaces "$1"); do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
		ip netns del "$ns" 2>/dev/null || true
	done
	ip link del "$1br" 2>/dev/null || true
}

cleanup() {
	local pid
	for pid in "${RANK_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
	for pid in "${RANK_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
	RANK_PIDS=()
	if [[ $MODE == netns ]]; then remove_run "$PREFIX"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ $SHAPE != both && $SHAPE != egress ]]; then
	echo "cluster.sh: BENCH_SHAPE must be both or egress, not $SHAPE" >&2
	exit 2
fi
if [[ $MODE == netns ]]; then
	# Leftovers of runs that were killed before they could clean up.
	for stale in $(ip netns list 2>/dev/null | sed -n 's/^\(okb[0-9]*\)-r[0-9]*.*/\1/p' | sort -u); do
		kill -0 "${stale#okb}" 2>/dev/null || remove_run "$stale"
	done
	ip link add "${PREFIX}br" type bridge
	ip link set "${PREFIX}br" up
	for ((r = 0; r < P; r++)); do
		ns=$PREFIX-r$r
		ip netns add "$ns"
		ip link add "${PREFIX}h$r" type veth peer name eth0 netns "$ns"
		ip link set "${PREFIX}h$r" master "${PREFIX}br" up
		ip netns exec "$ns" ip addr add 198.18.0.$((r + 1))/24 dev eth0
		ip netns exec "$ns" ip link set eth0 up
		ip netns exec "$ns" ip link set lo up
		# TCP hands the device segments of up to gso_max_size bytes (64 KiB
		# by default). tbf cuts any segment larger than its burst into
		# MTU-sized packets, and every one of them then crosses the veth
		# pair, the bridge and the receiver's TCP stack on its own: at
		# P = 16 and 200 Mbit/s that is ~270,000 packets a second for the
		# machine's few cores, which made the kernel, not the link, the
		# bottleneck (on a busy 2-core machine, P = 16, n = 2^20, against a
		# ring bound of 315 ms: torch gloo 1,263 ms, this library's ring
		# 1,600–1,900 ms; with segments kept under the burst 484 ms and
		# 500–650 ms, and the run's system CPU time less than half). So
		# segments stay below the burst and pass whole, and the burst stays
		# small: a token bucket lets one burst out at once after an idle
		# spell, an advantage of at most burst ÷ rate (1.3 ms at 200 Mbit/s).
		ip netns exec "$ns" ip link set dev eth0 gso_max_size "$GSO_BYTES"
		# The rank's link, both directions: its egress on eth0, its ingress
		# on the host end of the pair (what the bridge sends towards it).
		# With egress alone a rank could receive from several peers at once
		# at a multiple of the rate, which no NIC does.
		ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$BURST" latency 100ms
		if [[ $SHAPE == both ]]; then
			tc qdisc add dev "${PREFIX}h$r" root tbf rate "$RATE" burst "$BURST" latency 100ms
		fi
	done
elif [[ $MODE != loopback ]]; then
	echo "cluster.sh: BENCH_MODE must be netns or loopback, not $MODE" >&2
	exit 2
fi

run_job() { # one command line, once per rank; fails if any rank fails
	local r pid rc=0
	local env=(WORLD_SIZE="$P" MASTER_PORT="$PORT" OMP_NUM_THREADS=1)
	for ((r = 0; r < P; r++)); do
		local out=$OUT.r$r.log
		[[ $r == 0 ]] && out=$OUT.r0.out
		if [[ $MODE == netns ]]; then
			ip netns exec "$PREFIX-r$r" env "${env[@]}" RANK=$r LOCAL_RANK=$r MASTER_ADDR=198.18.0.1 \
				OKTOPK_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 bash -c "$1" >"$out" 2>>"$OUT.r$r.log" &
		else
			env "${env[@]}" RANK=$r LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 bash -c "$1" >"$out" 2>>"$OUT.r$r.log" &
		fi
		RANK_PIDS+=($!)
	done
	for pid in "${RANK_PIDS[@]}"; do wait "$pid" || rc=1; done
	RANK_PIDS=()
	cat "$OUT.r0.out" >>"$OUT"
	rm -f "$OUT.r0.out"
	PORT=$((PORT + 7))
	if [[ $rc != 0 ]]; then
		echo "cluster.sh: job failed: $1" >&2
		for ((r = 0; r < P; r++)); do tail -n 5 "$OUT.r$r.log" | sed "s/^/  rank $r: /" >&2; done
	fi
	return $rc
}

rm -f "$OUT".r*.log
for job in "$@"; do run_job "$job"; done
