"""The zero-line launcher: `python -m oktopk.run` runs an unchanged
script as torchrun would, with oktopk's hook on its DDP module (the
script's own hook left alone, a script without DDP told so)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(HERE, "launched_train.py")


def launch(base, *script_args, oktopk_flags=(), nproc=2, env=None):
    out = base / "out"
    out.mkdir(parents=True)
    port = free_port()
    cmd = [sys.executable, "-m", "oktopk.run", *oktopk_flags, "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT, "--out", str(out), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", **(env or {})))
    ranks = {int(f[4:-5]): json.load(open(out / f)) for f in os.listdir(out)}
    return p, ranks


def test_the_launcher_puts_the_hook_on_an_unchanged_scripts_ddp_and_it_sends(tmp_path):
    # Settings from flags and from a variable; ten steps, the first two
    # the dense warm-up, the next four the sparse probe (sparse_after=0:
    # sparse measured from the first step after the warm-up).
    p, ranks = launch(tmp_path, oktopk_flags=["--oktopk-density", "0.05", "--oktopk-sparse-after", "0"], env={"OKTOPK_TIMEOUT": "30"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(ranks) == [0, 1], p.stderr[-3000:]
    for r, res in ranks.items():
        assert res["hooks"] == ["oktopk.hook.oktopk_hook"], res
        assert len(res["bytes_sent"]) == 1 and res["bytes_sent"][0] > 0, res  # the library's calls, from the state
        assert res["argv"] == ["--out", str(tmp_path / "out")], res  # the script's own arguments, as torchrun passes them
    assert ranks[0]["params"] == ranks[1]["params"]
    said = [line for line in p.stderr.splitlines() if line.startswith("oktopk: oktopk_hook is on")]
    assert len(said) == 1, p.stderr[-3000:]  # rank 0 only, once
    assert "density=0.05" in said[0] and "timeout=30" in said[0] and "sparse_after=0" in said[0], said


def test_a_scripts_own_hook_is_left_alone_and_a_script_without_ddp_is_told(tmp_path):
    p, ranks = launch(tmp_path, "--own-hook", nproc=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ranks[0]["hooks"] == ["torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"], ranks
    assert "has its own comm hook (allreduce_hook): left as it is" in p.stderr, p.stderr[-3000:]
    p, ranks = launch(tmp_path / "without-ddp", "--no-ddp", nproc=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the script built no DistributedDataParallel" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("argv, says", [
    (["--oktopk-density", "0", "x.py"], "density"),
    (["--oktopk-dense-compression", "fp8", "x.py"], "dense_compression"),
    (["--oktopk-density"], "needs a value"),
    (["--no-python", "x.py"], "--no-python"),
])
def test_the_launcher_refuses_bad_settings_before_starting_a_rank(argv, says, capsys, monkeypatch):
    import oktopk.run

    for name in list(os.environ):
        if name.startswith("OKTOPK_") and name != "OKTOPK_LIBRARY":
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the flags' variables stay in this test
    assert oktopk.run.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("python -m oktopk.run: error:"), err


def test_callbacks_on_a_backends_future_are_counted_until_released_and_exit_waits_for_them():
    # oktopk.callbacks: a Python callback handed to Future.then is counted
    # from the hand-over until the backend releases it (here the future is
    # completed on this thread, so at once), and the exit hook returns at
    # once when none is left. A callback still held (the future not done)
    # keeps the count, and the exit hook waits for it, for at most its bound.
    import time

    import torch
    from oktopk import callbacks

    before = callbacks.alive()
    fut = torch.futures.Future()
    chained = callbacks.then(fut, lambda f: f.value() + 1)
    assert callbacks.alive() == before + 1
    fut.set_result(1)
    assert chained.wait() == 2 and callbacks.alive() == before
    pending = torch.futures.Future()
    callbacks.then(pending, lambda f: f.value())
    assert callbacks.alive() == before + 1
    bound, callbacks.DRAIN_SECONDS = callbacks.DRAIN_SECONDS, 0.2
    try:
        started = time.monotonic()
        callbacks._drain()
        assert 0.2 <= time.monotonic() - started < 1.0  # waited its bound for the held one
    finally:
        callbacks.DRAIN_SECONDS = bound
    pending.set_result(0)
    assert callbacks.alive() == before
    started = time.monotonic()
    callbacks._drain()
    assert time.monotonic() - started < 0.1
