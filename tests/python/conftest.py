import os
import random
import socket
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "plugins", "pytorch"))
sys.path.insert(0, os.path.join(ROOT, "examples", "pytorch"))
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "accuracy: trains to an accuracy; run by make test-accuracy, left out of make test")


def free_port():
    """A port free a moment ago, with the one above it (oktopk's rendezvous
    takes MASTER_PORT+1), both below the kernel's ephemeral range: a port
    inside it can be taken before rank 0 binds by any outgoing connection's
    source port, even by another rank's own dial to it (a Linux
    self-connection, whose TIME_WAIT then blocks the listener for a minute)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, low - 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair below the ephemeral range")
