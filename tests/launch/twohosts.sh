#!/usr/bin/env bash
# twohosts.sh C_TEST: C ranks on two hosts, made on one machine as two
# network namespaces joined by a veth pair (198.18.2.1 and 198.18.2.2), two
# ranks on each, started torchrun-style with MASTER_ADDR=198.18.2.1 and no
# interface or bind host configured (C_TEST is build/oktopk_test, its "join"
# mode).
#  1. Every rank binds the address on the route to MASTER_ADDR: the job
#     joins and allreduces. (A rank on the second host that bound loopback
#     would advertise an address the first host cannot reach.)
#  2. The second host's ranks are told to bind loopback
#     (OKTOPK_SOCKET_IFNAME=lo): every rank fails within its 3 s timeout,
#     the first host's naming the loopback addresses it could not reach and
#     the second host's naming their own.
# Needs root and iproute2; says so and skips otherwise.
set -u
C_TEST=$1
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
	echo "twohosts.sh: SKIPPED: needs root and iproute2 to make network namespaces"
	exit 0
fi
tag=$(head -c3 /dev/urandom | od -An -tx1 | tr -d ' \n')
A=okl-$tag-a B=okl-$tag-b
tmp=$(mktemp -d)
cleanup() {
	ip netns del "$A" 2>/dev/null
	ip netns del "$B" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
set -e
ip netns add "$A"
ip netns add "$B"
ip link add "okl${tag}a" netns "$A" type veth peer name "okl${tag}b" netns "$B"
ip -n "$A" addr add 198.18.2.1/24 dev "okl${tag}a"
ip -n "$B" addr add 198.18.2.2/24 dev "okl${tag}b"
for ns in "$A" "$B"; do
	ip -n "$ns" link set lo up
done
ip -n "$A" link set "okl${tag}a" up
ip -n "$B" link set "okl${tag}b" up
set +e

# run_job NAME TIMEOUT_MS [VAR=VALUE...]: four ranks, 0-1 in A and 2-3 in B;
# the variables go to B's ranks only. Sets elapsed_ms and status[r].
run_job() {
	local name=$1 timeout_ms=$2
	shift 2
	local pids=() r ns extra
	local t0
	t0=$(date +%s%N)
	for r in 0 1 2 3; do
		ns=$A extra=()
		if [ $r -ge 2 ]; then ns=$B extra=("$@"); fi
		ip netns exec "$ns" env -u OKTOPK_SOCKET_IFNAME RANK=$r WORLD_SIZE=4 MASTER_ADDR=198.18.2.1 MASTER_PORT=29500 \
			"${extra[@]}" timeout 60 "$C_TEST" join "$timeout_ms" >"$tmp/$name.$r" 2>&1 &
		pids+=($!)
	done
	for r in 0 1 2 3; do
		wait "${pids[$r]}"
		status[$r]=$?
	done
	elapsed_ms=$((($(date +%s%N) - t0) / 1000000))
	for r in 0 1 2 3; do sed "s/^/[$name rank $r] /" "$tmp/$name.$r"; done
}

fail=0
declare -a status
run_job routed 20000
for r in 0 1 2 3; do
	if [ "${status[$r]}" != 0 ] || ! grep -q "^joined: rank $r of 4" "$tmp/routed.$r"; then
		echo "twohosts.sh: FAIL: rank $r did not join across the two hosts without a configured interface (exit ${status[$r]})"
		fail=1
	fi
done

run_job loopback 3000 OKTOPK_SOCKET_IFNAME=lo
for r in 0 1 2 3; do
	if [ "${status[$r]}" != 3 ]; then
		echo "twohosts.sh: FAIL: rank $r exited ${status[$r]}, want a failed join (3) when the second host advertises loopback"
		fail=1
	fi
done
# Each rank's join fails within its timeout plus a second (closing its
# sockets lingers up to 200 ms), the whole job within a few seconds more.
for r in 0 1 2 3; do
	ms=$(sed -n 's/^JOIN FAILED after \([0-9]*\) ms.*/\1/p' "$tmp/loopback.$r")
	if [ -z "$ms" ] || [ "$ms" -gt 4000 ]; then
		echo "twohosts.sh: FAIL: rank $r's join failed after ${ms:-?} ms with a 3000 ms timeout"
		fail=1
	fi
done
if [ "$elapsed_ms" -gt 9000 ]; then
	echo "twohosts.sh: FAIL: the failing job took ${elapsed_ms} ms with a 3000 ms timeout"
	fail=1
fi
for r in 0 1; do
	for peer in 2 3; do
		if ! grep -q "rank $peer at tcp://127.0.0.1:" "$tmp/loopback.$r"; then
			echo "twohosts.sh: FAIL: rank $r's error does not name rank $peer's unreachable loopback address"
			fail=1
		fi
	done
done
for r in 2 3; do
	if ! grep -q "never connected to this rank's tcp://127.0.0.1:" "$tmp/loopback.$r"; then
		echo "twohosts.sh: FAIL: rank $r's error does not name its own loopback address"
		fail=1
	fi
done
[ $fail = 0 ] && echo "twohosts.sh: ok: routed addresses join across hosts; advertised loopback fails in ${elapsed_ms} ms naming the address"
exit $fail
