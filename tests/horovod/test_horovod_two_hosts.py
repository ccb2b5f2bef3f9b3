"""Horovod across two hosts: two network namespaces joined by a veth pair
(the interface has the same name on both sides, as on a cluster's nodes,
which Horovod's --network-interface needs), 198.18.3.1 and 198.18.3.2,
two ranks on each. Each host also gets its own hostname and /etc/hosts (a
UTS and a mount namespace), because Horovod 0.28's process-set Gloo
context binds the address its hostname resolves to, whatever the
interface. horovodrun runs on the first host and reaches the second
through a stand-in for ssh that runs the command there. Each rank must
bind its own host's address (the one on the route to horovodrun's
rendezvous server), and the density-1 sparse average through oktopk must
match Horovod's dense average on every rank."""

import os
import pickle
import shutil
import stat
import subprocess
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")

# on-host NETNS HOSTNAME HOSTS CMD...: runs CMD as if on that host.
ON_HOST = r"""#!/bin/sh
ns=$1 name=$2 hosts=$3
shift 3
exec ip netns exec "$ns" unshare --uts --mount --propagation private \
	sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' on-host "$name" "$hosts" "$@"
"""

# ssh as horovodrun calls it: `ssh [-o opt]... HOST [-p port] [-i file]
# [-o opt]... COMMAND...`; runs COMMAND on HOST through on-host, with the
# namespace OKTOPK_FAKE_SSH maps it to ("host=netns,host=netns").
FAKE_SSH = r"""#!/usr/bin/env bash
while [ "${1:-}" = -o ]; do shift 2; done
host=$1; shift
while [ $# -gt 0 ]; do
	case $1 in -o | -p | -i) shift 2 ;; *) break ;; esac
done
for pair in ${OKTOPK_FAKE_SSH//,/ }; do
	if [ "${pair%%=*}" = "$host" ]; then
		exec "$(dirname "$0")/on-host" "${pair#*=}" "$host" "$OKTOPK_FAKE_HOSTS" bash -c "$*"
	fi
done
echo "fake ssh: unknown host $host" >&2
exit 255
"""


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b, dev = f"okh-{tag}-a", f"okh-{tag}-b", f"okh{tag}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", dev, "netns", a, "type", "veth", "peer", "name", dev, "netns", b)
        for ns, addr in ((a, "198.18.3.1/24"), (b, "198.18.3.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield dev, [(a, "198.18.3.1"), (b, "198.18.3.2")]
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_horovodrun_across_two_hosts_binds_each_hosts_address(two_hosts, tmp_path):
    dev, hosts = two_hosts
    (ns_a, addr_a), (ns_b, addr_b) = hosts
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script(bindir / "ssh", FAKE_SSH)
    script(bindir / "on-host", ON_HOST)
    etc_hosts = tmp_path / "hosts"
    etc_hosts.write_text(f"127.0.0.1 localhost\n{addr_a} okhost-a\n{addr_b} okhost-b\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OKTOPK_SOCKET_IFNAME"}
    env.update(PATH=f"{bindir}:{env['PATH']}", OKTOPK_FAKE_SSH=f"okhost-a={ns_a},okhost-b={ns_b}",
               OKTOPK_FAKE_HOSTS=str(etc_hosts), OMP_NUM_THREADS="1")
    cmd = [str(bindir / "on-host"), ns_a, "okhost-a", str(etc_hosts),
           HOROVODRUN, "--gloo", "-np", "4", "-H", "okhost-a:2,okhost-b:2", "--network-interface", dev,
           sys.executable, os.path.join(HERE, "workers.py"), "density_one", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=HERE)
    assert proc.returncode == 0, f"horovodrun exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = {}
    for r in range(4):
        with open(out / f"rank{r}.pkl", "rb") as f:
            results[r] = pickle.load(f)
    # Ranks 0-1 run on the first host, 2-3 on the second (-H order).
    for r, res in results.items():
        want = addr_a if r < 2 else addr_b
        assert res["endpoint"].startswith(f"tcp://{want}:"), f"rank {r} advertised {res['endpoint']}, want {want}"
        assert res["worst_relative_diff"] <= 1e-5, f"rank {r}: {res['worst_relative_diff']}"
        assert res["bytes_sent"] > 0 and res["horovod_reductions"] == 0, res
    assert all(res["grad_digests"] == results[0]["grad_digests"] for res in results.values())
