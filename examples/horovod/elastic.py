"""The digits CNN of examples/pytorch/cnn.py under horovodrun's elastic
mode with oktopk's sparse allreduce: ranks may be lost and come back
during the run. ``oktopk_horovod.elastic.State`` takes
``hvd.elastic.TorchState``'s place (docs/failures.md says what it keeps):

    horovodrun --gloo -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/horovod/elastic.py --ckpt /shared/ckpt

``hosts.sh`` prints the hosts and their slots (``node1:2``), one a line,
as Horovod's elastic mode asks. The batch each rank takes is drawn from
the step and its rank, so a re-formed job goes on from the last commit.
"""

import argparse
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pytorch"))
from cnn import VGGStyle, accuracy, digits  # noqa: E402  the same model and data as the DDP example

import oktopk_horovod  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="where each rank keeps its oktopk state of the last commit")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--commit-every", type=int, default=10, help="steps between commits (a lost rank costs up to this many)")
    args = ap.parse_args(argv)

    hvd.init()
    torch.manual_seed(0)
    (x, y), (xt, yt) = digits()
    model = VGGStyle()
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                              named_parameters=model.named_parameters(),
                                              compression=oktopk_horovod.Compression.oktopk(density=args.density))
    state = oktopk_horovod.elastic.State(model, opt, checkpoint_dir=args.ckpt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            batch = torch.randint(0, len(y), (args.batch_size,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    if hvd.rank() == 0:
        print(f"RESULT steps={state.step} ranks={hvd.size()} accuracy={accuracy(model, xt, yt):.2f} "
              f"resets_without_state={state.resets_without_state}", flush=True)
    opt.close()


if __name__ == "__main__":
    main()
