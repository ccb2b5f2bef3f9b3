"""PyTorch Lightning (examples/frameworks/lightning_train.py): a CNN on
Fashion-MNIST with SGD and momentum on 2 CPU ranks, the hook through
DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...), Lightning's
checkpoint at each epoch's end and fit(ckpt_path=...); and what
DDPStrategy does with a comm hook on CPU by itself."""

import os
import subprocess
import sys
import textwrap

import torch
from fwutil import EXAMPLES, ROOT, free_port, launch, tail


def test_lightning_sends_through_the_hook_and_a_resumed_fit_continues_bitwise(tmp_path):
    # 2 epochs of 3 steps, a checkpoint after each: the resumed fit starts
    # at step 3, in the middle of the hook's sparse probe (steps 2-5), so
    # it matches only if every rank got its own residuals and the probe's
    # position back from Lightning's checkpoint. Within those 6 steps every
    # step's path is fixed by its number (a choice by measured time could
    # come at step 6 at the earliest, and differ between the two runs).
    # With gradient_clip_val (clip_grad_norm_'s rule, at 0.5: it bites) and
    # bf16-mixed, as the users run it: the momentum correction
    # follows the clip and stays on.
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    common = ["--oktopk", "--batches", "3", "--clip", "0.5", "--precision", "bf16-mixed"]
    p, ranks = launch("lightning_train.py", ["--out", whole, *common], tmp_path / "whole-stats")
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        (state,) = rank["states"]
        assert state["bytes_sent"] > 0 and state["choice"]["steps"]["sparse"] > 0, state
        assert state["momentum_status"] == "on", state
    assert "momentum correction stopped" not in p.stderr, tail(p)
    saved = torch.load(whole / "epoch=0-step=3.ckpt", weights_only=False)
    (every_rank,) = [v["oktopk_every_rank"] for v in saved["callbacks"].values() if "oktopk_every_rank" in v]
    assert [s["rank"] for s in every_rank] == [0, 1]  # rank 0 wrote the file; it holds both ranks' states

    p, ranks = launch("lightning_train.py", ["--out", resumed, *common, "--resume", whole / "epoch=0-step=3.ckpt"],
                      tmp_path / "resumed-stats")
    assert p.returncode == 0, tail(p)
    for rank in ranks.values():
        assert rank["states"][0]["bytes_sent"] > 0, rank
    a = torch.load(whole / "epoch=1-step=6.ckpt", weights_only=False)["state_dict"]
    b = torch.load(resumed / "epoch=1-step=6.ckpt", weights_only=False)["state_dict"]
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def test_ddpstrategy_alone_registers_no_comm_hook_on_cpu(tmp_path):
    # Lightning 2.6's DDPStrategy registers ddp_comm_hook only when its root
    # device is CUDA, and says nothing on CPU: the module trains with DDP's
    # allreduce and the state is never called. One process suffices to see
    # it (a world of 1, Lightning's own DDP setup in this process).
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "plugins", "pytorch")!r})
        import pytorch_lightning as pl, torch
        from pytorch_lightning.strategies import DDPStrategy
        from oktopk import OkTopkState, oktopk_hook

        class Net(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 2)
            def training_step(self, batch, i):
                return self.lin(batch[0]).square().mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            def on_train_start(self):
                self.hooks = list(getattr(self.trainer.strategy.model, "_comm_hooks", []))

        state = OkTopkState()
        net = Net()
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=oktopk_hook),
                             max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)
        trainer.fit(net, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4))
        print("DDP", type(trainer.strategy).__name__, "hooks", len(net.hooks), "steps", sum(state.choice["steps"].values()))
    """)
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=EXAMPLES)
    assert p.returncode == 0, tail(p)
    assert "DDP DDPStrategy hooks 0 steps 0" in p.stdout, tail(p)
