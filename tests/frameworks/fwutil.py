"""Launching the framework examples (examples/frameworks) on 2 CPU ranks
for the tests, and reading what they left."""

import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples", "frameworks")
_spec = importlib.util.spec_from_file_location("python_tests_conftest", os.path.join(ROOT, "tests", "python", "conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
free_port = _conftest.free_port


def launch(example, args, stats, launcher="torchrun", nproc=2, timeout=240, env=None):
    """Run examples/frameworks/EXAMPLE with ARGS on NPROC ranks under
    torchrun, or under oktopk's launcher (``launcher="oktopk"``), through
    with_stats.py; returns (completed process, {rank: stats})."""
    os.makedirs(stats, exist_ok=True)
    module = {"torchrun": "torch.distributed.run", "oktopk": "oktopk.run"}[launcher]
    cmd = [sys.executable, "-m", module, "--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.join(HERE, "with_stats.py"), os.path.join(EXAMPLES, example),
           *[str(a) for a in args]]
    # Sparse from the first step after the warm-up (with_stats.py says why),
    # unless the test names its own (FW_ONE_LINE="{}": the one line as it is).
    run_env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", FW_STATS=str(stats),
                   TOKENIZERS_PARALLELISM="false", FW_ONE_LINE=json.dumps({"sparse_after": 0}), OKTOPK_SPARSE_AFTER="0")
    run_env.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)
    ranks = {int(f[4:-5]): json.load(open(os.path.join(stats, f))) for f in os.listdir(stats) if f.endswith(".json")}
    return p, ranks


def tail(p, n=4000):
    return (p.stdout + p.stderr)[-n:]
