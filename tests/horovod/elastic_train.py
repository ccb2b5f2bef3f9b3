"""Training under horovodrun's elastic mode with oktopk's optimizer
(tests/horovod/test_horovod.py): SGD with momentum through
oktopk_horovod.DistributedOptimizer, a commit after every step, the
batches drawn from the step and the rank. ``--kill-at S``: the first
process of rank 1 SIGKILLs itself in step S, before its backward; horovodrun
starts a new one in its place. Each rank writes its parameters' digest,
the world sizes it was reset to, what the last sync did with the oktopk
states and how many resets dropped one."""

import argparse
import hashlib
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import oktopk_horovod

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--ckpt", required=True)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--kill-at", type=int, default=-1)
ap.add_argument("--step-seconds", type=float, default=0.0)
ap.add_argument("--until-size", type=int, default=0, help="go on past --steps (to 400) until 3 steps with this many ranks")
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                          named_parameters=model.named_parameters(),
                                          compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.05, timeout=20),
                                          bucket_bytes=4096)
state = oktopk_horovod.elastic.State(model, opt, checkpoint_dir=args.ckpt, step=0)
restarts = []
state.register_reset_callbacks([lambda: restarts.append(hvd.size())])


@hvd.elastic.run
def train(state):
    full = 0  # steps taken by this call with --until-size ranks (every rank's call began at the same reset)
    while state.step < args.steps or (args.until_size and full < 3 and state.step < 400):
        full += hvd.size() >= args.until_size
        g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        marker = os.path.join(args.ckpt, "killed")
        if state.step == args.kill_at and hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        state.step += 1
        time.sleep(args.step_seconds)
        state.commit()


train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump({"digest": digest, "resets": restarts, "last_restart": state.last_restart,
               "dropped": state.resets_without_state, "bytes_sent": opt.bytes_sent, "step": state.step}, f)
opt.close()
