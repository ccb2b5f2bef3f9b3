"""Elastic restarts: a rank killed mid-run, torchrun's agent starts the
group again, and every rank resumes from the newest checkpoint every rank
saved (examples/pytorch/elastic.py), ending where an uninterrupted run
ends, bit for bit."""

import json
import os
import subprocess
import sys

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "pytorch", "elastic.py")


def elastic_run(base, launcher, restarts, *script_args, env=None):
    ckpt, out = base / "ckpt", base / "out"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", launcher, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", base.name,
           SCRIPT, "--ckpt", str(ckpt), "--out", str(out), "--steps", "12", "--save-every", "3", "--algorithm", "oktopk",
           *script_args]
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=dict(environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", **(env or {})))
    ranks = {int(f[4:-5]): json.load(open(out / f)) for f in os.listdir(out)}
    return p, ranks


def test_a_killed_rank_restarts_the_group_which_resumes_bitwise_from_its_checkpoint(tmp_path):
    # Uninterrupted: 12 steps. Killed: rank 1 SIGKILLs itself in step 7 of
    # the first attempt, after the checkpoints of steps 3 and 6; torchrun's
    # agent (here through the zero-line launcher, which keeps each attempt
    # on a store of its own) starts both ranks again, and they resume after
    # step 6: the library's communicator is set up anew (its job token
    # and endpoints of this attempt, not the first's), and the residuals,
    # momentum and parameters come from the checkpoint.
    p, whole = elastic_run(tmp_path / "whole", "torch.distributed.run", 0, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    p, killed = elastic_run(tmp_path / "killed", "oktopk.run", 1, "--kill-at", "7", "--kill-rank", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(whole) == sorted(killed) == [0, 1], p.stderr[-3000:]
    for r in (0, 1):
        assert whole[r]["attempt"] == 0 and whole[r]["resumed"] is None, whole[r]
        assert killed[r]["attempt"] == 1 and killed[r]["resumed"] == 6, killed[r]
        assert killed[r]["bytes_sent"] > 0, killed[r]  # sparse steps after the restart, over the new communicator
        assert killed[r]["params"] == whole[r]["params"], f"rank {r}: the resumed run's parameters differ from the uninterrupted run's"
    assert killed[0]["params"] == killed[1]["params"]
