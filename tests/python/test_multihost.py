"""Two hosts on one machine: two network namespaces joined by a veth pair,
each with its own address, running `torchrun --nnodes 2 --nproc-per-node 2`.
oktopk must bind the host's own address (not loopback): the interface
OKTOPK_SOCKET_IFNAME names, or without it the address on the route to the
store's host (MASTER_ADDR), and the 4 ranks must end with identical
parameters."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"oktt-{tag}-a", f"oktt-{tag}-b"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"okv{tag}a", "netns", a, "type", "veth", "peer", "name", f"okv{tag}b", "netns", b)
        for ns, dev, addr in ((a, f"okv{tag}a", "198.18.1.1/24"), (b, f"okv{tag}b", "198.18.1.2/24")):
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", addr, "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield [(a, f"okv{tag}a", "198.18.1.1"), (b, f"okv{tag}b", "198.18.1.2")]
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


@pytest.mark.parametrize("name_interface", [True, False], ids=["OKTOPK_SOCKET_IFNAME", "default"])
def test_torchrun_two_nodes_binds_the_host_address(two_hosts, name_interface):
    port = 29400 + os.getpid() % 500 + (0 if name_interface else 7)
    procs = []
    for node, (ns, dev, addr) in enumerate(two_hosts):
        env = {k: v for k, v in os.environ.items() if k != "OKTOPK_SOCKET_IFNAME"}
        env.update(GLOO_SOCKET_IFNAME=dev, EXPECT_HOST=addr, OMP_NUM_THREADS="1")
        if name_interface:
            env["OKTOPK_SOCKET_IFNAME"] = dev
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", "198.18.1.1",
               "--master-port", str(port), os.path.join(HERE, "multihost_train.py")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-node run did not finish in 180 s")
        outs.append(out)
    report = "\n".join(line for out in outs for line in out.splitlines() if "endpoint" in line or "Error" in line)
    assert all(p.returncode == 0 for p in procs), f"exit codes {[p.returncode for p in procs]}\n{report}\n{outs[0][-3000:]}"
    assert report.count("parameters identical on all ranks: True") == 4, report


def test_store_on_loopback_keeps_the_library_default():
    # A single-machine job (MASTER_ADDR loopback) binds loopback as before.
    from oktopk.comm import route_source_address

    for host in ("127.0.0.1", "localhost", "::1"):
        assert route_source_address(host, 29500) is None, host


def test_named_interface_wins_over_the_route(monkeypatch):
    from oktopk.comm import default_bind_host

    monkeypatch.setenv("OKTOPK_SOCKET_IFNAME", "eth0")
    assert default_bind_host() is None  # the library then uses OKTOPK_SOCKET_IFNAME's address
