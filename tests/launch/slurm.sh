#!/usr/bin/env bash
# slurm.sh BUILD PYTHON: a single-node Slurm made for the test (munged,
# slurmctld and slurmd in the foreground, with a key, a config and their
# state in a temporary folder, on free ports), then
#  1. `srun -n 4 build/trainer`: oktopk_comm_init_env joins from Slurm's
#     variables alone (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the
#     rendezvous host from SLURM_STEP_NODELIST);
#  2. `srun -n 4 PYTHON slurm_ddp.py`: DDP with oktopk's hook, the way a
#     Slurm user's script starts it.
# Where Slurm cannot start here (no munge, a daemon that exits, a node that
# never comes up), it prints SKIPPED with the reason and the daemons' last
# log lines, and exits 0.
set -u
BUILD=$1
PY=$2
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"

skip() {
	echo "slurm.sh: SKIPPED: $*"
	for log in "$tmp"/*.log; do
		[ -f "$log" ] && tail -n 5 "$log" | sed "s|^|  $(basename "$log"): |"
	done
	exit 0
}
for tool in munged slurmctld slurmd srun sinfo scontrol; do
	command -v $tool >/dev/null || { tmp=/nonexistent; skip "$tool not found (make deps-launch installs slurmctld, slurmd, slurm-client and munge)"; }
done

tmp=$(mktemp -d)
daemons=()
# Stopped in the reverse order of their start, once this cluster's jobs
# have ended: a step's slurmstepd reports its end to slurmctld, signed by
# munged, and with either gone it retries while slurmd waits for it (seen
# under load: srun had returned before its step's report, and the cleanup
# waited on slurmd for good). Each daemon gets 20 s after SIGTERM, then
# SIGKILL: a cleanup never hangs.
cleanup() {
	local pid i
	if [ ${#daemons[@]} = 3 ]; then
		for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
	fi
	for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
		pid=${daemons[i]}
		kill "$pid" 2>/dev/null || continue
		for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
		kill -9 "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
	done
	rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/state" "$tmp/spool"

# munge: its own key and socket, nothing of the system's.
head -c 1024 /dev/urandom >"$tmp/munge.key"
chmod 600 "$tmp/munge.key"
munged --foreground --force --socket="$tmp/munge.sock" --key-file="$tmp/munge.key" --log-file="$tmp/munged.log" \
	--pid-file="$tmp/munged.pid" --seed-file="$tmp/munged.seed" 2>>"$tmp/munged.log" &
daemons+=($!)
for _ in $(seq 50); do [ -S "$tmp/munge.sock" ] && break; sleep 0.1; done
[ -S "$tmp/munge.sock" ] || skip "munged did not create its socket"

# The node is this host under its own name when the name resolves (the
# rendezvous host comes from the node list), else localhost.
node=$(hostname -s)
getent hosts "$node" >/dev/null || node=localhost
ctld_port=$(free_port) || exit 1
slurmd_port=$(free_port) || exit 1
cat >"$tmp/slurm.conf" <<EOF
ClusterName=oktopk-test
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$tmp/munge.sock
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=10 State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$tmp/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" 2>>"$tmp/slurmctld.log" &
daemons+=($!)
slurmd_args=(-D -f "$SLURM_CONF")
[ "$node" = localhost ] && slurmd_args+=(-N localhost)
slurmd "${slurmd_args[@]}" 2>>"$tmp/slurmd.log" &
daemons+=($!)
state=""
for _ in $(seq 60); do
	state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
	[ "$state" = idle ] && break
	for pid in "${daemons[@]}"; do
		kill -0 "$pid" 2>/dev/null || skip "a Slurm daemon (pid $pid) exited during start-up"
	done
	sleep 0.5
done
[ "$state" = idle ] || skip "node $node not idle after 30 s (state '${state:-none}')"
echo "slurm.sh: single-node Slurm up (node $node, slurmctld port $ctld_port)"

status=0
rdv=$(free_port) || exit 1
store=$(free_port) || exit 1
# run COUNT WHAT SRUN_ARGS...: srun with torchrun's variables unset; fails
# the test unless it exits 0 and prints COUNT lines holding WHAT.
run() {
	local count=$1 what=$2
	shift 2
	echo "== srun -n 4 $*"
	local t0=$SECONDS out
	out=$(env "${UNSET_TORCHRUN[@]}" OKTOPK_RENDEZVOUS_PORT=$rdv OMP_NUM_THREADS=1 \
		timeout 240 srun -n 4 --overcommit --time=5 --kill-on-bad-exit=1 "$@" 2>&1)
	local rc=$?
	echo "$out" | tail -n 6
	if [ $rc != 0 ] || [ "$(grep -c "$what" <<<"$out")" != "$count" ]; then
		echo "slurm.sh: FAIL: srun -n 4 $* exited $rc (want 0 and $count lines \"$what\")"
		status=1
	else
		echo "slurm.sh: ok in $((SECONDS - t0)) s"
	fi
}
run 1 "ok: oktopk's final loss is within" "$BUILD/trainer"
master=$(scontrol show hostnames "$node" | head -n 1)
run 4 "parameters identical on all tasks: True" env MASTER_ADDR="$master" MASTER_PORT="$store" "$PY" "$HERE/slurm_ddp.py"
exit $status
