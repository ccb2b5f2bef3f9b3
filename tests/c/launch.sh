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

# A free port, and the one after it for rendezvous (free_port says why
# below the ephemeral range).
. "$(dirname "$0")/../launch/lib.sh"
port=$(free_port) || exit 1

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
