#!/usr/bin/env bash
# mpirun.sh BUILD: the C ABI under Open MPI's mpirun, 4 ranks on this host.
#  1. build/trainer joins with oktopk_comm_init_env from mpirun's own
#     variables alone (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_SIZE; no RANK,
#     WORLD_SIZE or MASTER_ADDR) and trains dense and Ok-Topk to the same
#     loss (it exits nonzero otherwise).
#  2. build/mpi_example passes a unique id with MPI_Bcast, NCCL's way, and
#     checks oktopk's results against MPI_Allreduce.
set -u
BUILD=$1
. "$(dirname "$0")/lib.sh"
for tool in mpirun; do
	command -v $tool >/dev/null || { echo "mpirun.sh: FAIL: $tool not found (make deps-launch installs Open MPI)"; exit 1; }
done
# Open MPI refuses root unless told; the ranks outnumber a small machine's
# cores, which it also refuses unless told.
flags=(--oversubscribe)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
port=$(free_port) || exit 1
status=0
run() {
	local what=$1
	shift
	echo "== mpirun -np 4 $*"
	local t0=$SECONDS out
	out=$(env "${UNSET_TORCHRUN[@]}" OKTOPK_RENDEZVOUS_PORT=$port timeout 180 mpirun -np 4 "${flags[@]}" -x OKTOPK_RENDEZVOUS_PORT "$@" 2>&1)
	local rc=$?
	echo "$out" | tail -n 6
	if [ $rc != 0 ] || ! grep -q "$what" <<<"$out"; then
		echo "mpirun.sh: FAIL: mpirun -np 4 $* exited $rc (want 0 and \"$what\")"
		status=1
	else
		echo "mpirun.sh: ok in $((SECONDS - t0)) s"
	fi
}
run "ok: oktopk's final loss is within" "$BUILD/trainer"
run "ok: 4 ranks, unique id passed with MPI_Bcast" "$BUILD/mpi_example"
exit $status
