import os
import socket
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "plugins", "pytorch"))
sys.path.insert(0, os.path.join(ROOT, "examples", "pytorch"))
sys.path.insert(0, os.path.dirname(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
