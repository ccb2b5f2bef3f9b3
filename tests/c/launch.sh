#!/usr/bin/env bash
# launch.sh P PROGRAM ARGS...: runs P copies of PROGRAM on 127.0.0.1 the way
# torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), waits for all,
# and fails unless every copy exits 0 and every "HASH <name> <hex>" line it
# prints is the same on every rank (bitwise identical results).
# OKTOPK_TEST_DIR names a directory the ranks share for the test's own
# signals; it is removed at the end.
set -u
P=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A free port, and the one after it for rendezvous, both below the kernel's
# ephemeral range: a port inside it can be taken between our check and rank
# 0's bind by any outgoing connection's source port — even by another rank's
# own dial to it, which Linux can turn into a self-connection whose TIME_WAIT
# then blocks the listener for a minute (torchrun's default 29500 is below the
# range for the same reason).
free_port() {
	local low p
	low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
	for _ in $(seq 50); do
		p=$((10000 + RANDOM % (low - 10002)))
		if ! (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null && ! (exec 3<>/dev/tcp/127.0.0.1/$((p + 1))) 2>/dev/null; then
			echo "$p"
			return
		fi
	done
	echo "launch.sh: no free port found" >&2
	exit 1
}
port=$(free_port)

pids=()
for ((r = 0; r < P; r++)); do
	OKTOPK_TEST_DIR=$tmp RANK=$r WORLD_SIZE=$P MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OKTOPK_RENDEZVOUS_PORT=$((port + 1)) \
		"$@" >"$tmp/out.$r" 2>"$tmp/err.$r" &
	pids+=($!)
done
status=0
for ((r = 0; r < P; r++)); do
	if ! wait "${pids[$r]}"; then
		echo "launch.sh: rank $r failed" >&2
		status=1
	fi
done
for ((r = 0; r < P; r++)); do
	sed "s/^/[rank $r] /" "$tmp/out.$r"
	sed "s/^/[rank $r] /" "$tmp/err.$r" >&2
done
if [ $status -eq 0 ]; then
	for ((r = 1; r < P; r++)); do
		if ! diff <(grep '^HASH ' "$tmp/out.0") <(grep '^HASH ' "$tmp/out.$r") >&2; then
			echo "launch.sh: rank $r's results differ from rank 0's" >&2
			status=1
		fi
	done
	echo "launch.sh: $P ranks exited 0; $(grep -c '^HASH ' "$tmp/out.0") result hashes equal on every rank"
fi
exit $status
