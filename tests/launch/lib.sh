# Shared by the launch tests and tests/c/launch.sh (sourced, not run).

# free_port: a port that was free a moment ago, with the one after it, both
# below the kernel's ephemeral range: a port inside it can be taken between
# the check and the listener's bind by any outgoing connection's source port,
# even by another rank's own dial to it, which Linux can turn into a
# self-connection whose TIME_WAIT then blocks the listener for a minute
# (torchrun's default 29500 is below the range for the same reason).
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
	echo "no free port found" >&2
	return 1
}

# The launchers' own rank variables must decide: none of torchrun's may leak
# in from the caller's environment.
UNSET_TORCHRUN=(-u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u OKTOPK_SOCKET_IFNAME)
