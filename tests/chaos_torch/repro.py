"""Minimal reproductions of the PyTorch plugin's findings of the fault
campaign (results/chaos_torch.md, "Findings"): 2 spawned gloo ranks on
CPU, the plugin's public API only. Each case prints what it saw and the
script exits 1 while any reproduces.

    PYTHONPATH=plugins/pytorch OMP_NUM_THREADS=1 $(make -s print-py) tests/chaos_torch/repro.py [CASE ...]

Cases:

warmup-timing  A run of the measured choice (algorithm=None) on a slow link
               (here: the loop sleeps 0.3 s after every dense step) chooses
               sparse at its first decision without a native probe: the
               sparse probe took at most half of the last warm-up step. That
               step's time is taken at the first bucket of the step after
               it, so a checkpoint saved at the end of the warm-up does not
               hold it (nor does a resumed process time its own first
               step): resumed from there, the run probes native for 4 (slow)
               steps instead, and ends with other parameters. Also resumed
               from before the last warm-up step, which the resumed process
               runs first (in DDP's provisional layout) and must time too.
warmup-adam    Under AdamW the ranks agree at the first step after the
               warm-up that an Adam-family optimizer steps the parameters,
               and measure bf16 (dense_compression) against native (on the
               same slow link: bf16 wins clearly). A run resumed from a
               checkpoint saved at the end of the warm-up has not seen its
               optimizer step yet at that step: it probes sparse under
               AdamW instead, then goes native for good.
nan-one-group  A NaN in one parameter's gradient on one rank, with several
               groups (DDP buckets; FSDP2 has one per module): the group it
               is in is skipped on every rank and comes back NaN, so the
               script skips the optimizer step (as GradScaler does); but the
               other groups were reduced, their residuals sent and updated,
               their velocities advanced. The state after the skipped step
               is not the state before it: what those groups sent is lost.
switch-fold    A run of the measured choice whose sparse probe loses (the loop
               sleeps 0.3 s after each sparse step) switches to native at the
               step after the probe, folding each group's residual into that
               native step. Resumed from a checkpoint saved just before that
               step, it takes the same paths, but the residual is not folded:
               the fold needs the communicator, which the resumed process makes
               only at its next sparse step. Other parameters. And with
               groups that span DDP's provisional buckets (the resumed
               step's), those buckets went through the sparse path instead
               of the native allreduce. Other parameters.
no-state       state_dict() raises OkTopkError ("tensor ... has no state
               yet") with a named dense algorithm (every step after the
               warm-up), and after a NaN at the first sparse step (until the
               next sparse step): no checkpoint can be taken there.
"""

import copy
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "pytorch"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def batch(rank, g):
    gen = torch.Generator().manual_seed(100 * g + rank)
    return torch.randn(8, 20, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def params_of(model):
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def path_taken(state, before, g):
    if g < state.warmup_iters:
        return "warm-up"
    after = state.choice["steps"]
    return next(p for p in after if after[p] != before[p])


def deep():
    """Four layers in buckets of about 2 kB: DDP's provisional buckets
    (a resumed process's first step) are not its rebuilt ones."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))
    return DDP(net, bucket_cap_mb=0.002)


def resumed_paths(rank, optimizer, slow_dense, steps=14, cut=2, slow_sparse=False, model=lambda: DDP(small())):
    """The whole run's paths and parameters from ``cut`` on, and those of the
    run resumed from its checkpoint saved after step cut - 1."""
    import oktopk

    def train(first, saved=None):
        ddp = model()
        # sparse_after=0: the findings are the sparse probe's, which the
        # default's early 4-bit steps would put off for 100 steps.
        state = oktopk.OkTopkState(density=0.05, recheck_every=8, sparse_after=0)
        ddp.register_comm_hook(state, oktopk.oktopk_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(ddp.parameters(), lr=0.05)
        if saved is not None:
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["oktopk"])
        paths, checkpoint = [], None
        for g in range(first, steps):
            before = dict(state.choice["steps"])
            x, y = batch(rank, g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            paths.append(path_taken(state, before, g))
            if slow_dense and paths[-1] in ("warm-up", "native"):
                time.sleep(0.3)  # a slow link: every dense step is slow
            if slow_sparse and paths[-1] == "sparse":
                time.sleep(0.3)  # sparse loses: the native probe follows, and wins
            if g + 1 == cut:
                # Copies: the optimizer's state tensors (AdamW's moments)
                # go on changing in place with the run.
                checkpoint = copy.deepcopy({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "oktopk": state.state_dict()})
        out = (paths, params_of(ddp), checkpoint)
        state.close()
        return out

    whole, whole_params, checkpoint = train(0)
    resumed, resumed_params, _ = train(cut, checkpoint)
    same = whole[cut:] == resumed and whole_params == resumed_params
    return same, f"whole   {whole[cut:]}\nresumed {resumed}\nparameters {'equal' if whole_params == resumed_params else 'differ'}"


def case_warmup_timing(rank):
    # Saved at the end of the warm-up (cut 2) and before its last step (cut
    # 1, which the resumed process runs first, in DDP's provisional layout).
    results = [resumed_paths(rank, "sgd", slow_dense=True, cut=cut) for cut in (1, 2)]
    return all(same for same, _ in results), "\n".join(f"cut {cut}:\n{text}" for cut, (_, text) in zip((1, 2), results))


def case_warmup_adam(rank):
    # On a slow link (bf16 steps are not slowed): bf16 wins clearly at the
    # first decision, whatever the noise of this machine's steps.
    return resumed_paths(rank, "adamw", slow_dense=True)


def case_switch_fold(rank):
    # The sparse probe is steps 2-5 (s 0-3); no clear win, so the native
    # probe starts at step 6 (s 4), whose native steps fold the residuals.
    # The deep model's groups span DDP's provisional buckets: the resumed
    # step gathers each group to fold and allreduce it (found later, by
    # the campaign's job 20 of seed 7).
    results = [resumed_paths(rank, "sgd", slow_dense=False, slow_sparse=True, steps=12, cut=6, model=m) for m in (lambda: DDP(small()), deep)]
    return all(same for same, _ in results), "\n".join(f"{name}:\n{text}" for name, (_, text) in zip(("small", "deep"), results))


def case_nan_one_group(rank):
    import oktopk

    lines, ok = [], True
    for name, kwargs, optimizer in (("library residuals", {"algorithm": "oktopk"}, "sgd"),
                                    ("velocities (momentum correction)", {"algorithm": "oktopk"}, "sgdm")):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))
        model = DDP(net, bucket_cap_mb=0.002)  # several buckets
        state = oktopk.OkTopkState(density=0.05, **kwargs)
        model.register_comm_hook(state, oktopk.oktopk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if optimizer == "sgdm" else 0.0)
        bad_step = 5 if optimizer == "sgd" else 1
        for g in range(bad_step + 1):
            x, y = batch(rank, g)
            opt.zero_grad()
            before = state.state_dict()
            if g == bad_step and rank == 1:
                handle = net[0].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([3]), float("nan")))
            F.cross_entropy(model(x), y).backward()
            if g == bad_step and rank == 1:
                handle.remove()
            finite = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
            if all(finite):
                opt.step()
        after = state.state_dict()
        if name.startswith("library"):
            moved = [k for k in before["tensors"] if not before["tensors"][k] == after["tensors"].get(k)]
            total = len(before["tensors"])
        else:
            moved = [i for i, e in before["momentum"].items()
                     if (e["velocity"] is None) != (after["momentum"][i]["velocity"] is None)
                     or e["velocity"] is not None and not torch.equal(e["velocity"], after["momentum"][i]["velocity"])]
            total = len(before["momentum"])
        lines.append(f"{name}: step {bad_step} skipped (non-finite on this rank: {not all(finite)}); "
                     f"{len(moved)} of {total} changed by it")
        ok = ok and not moved and not all(finite)
        state.close()
    return ok, "\n".join(lines)


def case_no_state(rank):
    import oktopk

    lines, ok = [], True
    for name, kwargs, nan_at in (("algorithm='dense_ring'", {"algorithm": "dense_ring"}, None),
                                 ("algorithm='oktopk', NaN at the first sparse step", {"algorithm": "oktopk"}, 2),
                                 ("algorithm=None (the default), NaN at the first sparse step", {}, 2)):
        model = DDP(small())
        state = oktopk.OkTopkState(density=0.05, **kwargs)
        model.register_comm_hook(state, oktopk.oktopk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        seen = []
        for g in range(4):
            x, y = batch(rank, g)
            if g == nan_at and rank == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                opt.step()
            try:
                state.state_dict()
                seen.append("ok")
            except Exception as e:  # noqa: BLE001 - the finding
                seen.append(f"{type(e).__name__}")
                last = str(e)
        lines.append(f"{name}: state_dict() after each step: {seen}")
        if any(s != "ok" for s in seen):
            lines.append(f"  {last}")
            ok = False
        state.close()
    return ok, "\n".join(lines)


CASES = {"warmup-timing": case_warmup_timing, "warmup-adam": case_warmup_adam, "switch-fold": case_switch_fold,
         "nan-one-group": case_nan_one_group, "no-state": case_no_state}


def run_cases(rank, world, port, cases):
    """(case, fixed, what it saw) of each of ``cases`` in turn, as each ends,
    on this rank of a new gloo group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name in cases:
        yield (name, *CASES[name](rank))


def rank_main(rank, world, port, out, cases):
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        for name, ok, text in run_cases(rank, world, port, cases):
            f.write(f"== {name}: {'fixed' if ok else 'REPRODUCED'} (rank {rank})\n{text}\n")
            f.flush()  # what a case that crashes the rank leaves behind
    sys.stdout.flush()
    os._exit(0)  # see tests/python/workers.py, exit_when_done


def rank_results(rank, world, port, out, cases):
    """run_cases as tests/python's run() calls a rank (test_chaos_torch.py:
    ranks forked from its server, which imported torch once, instead of
    this script's three fresh interpreters): what each case saw, pickled."""
    import pickle

    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(list(run_cases(rank, world, port, cases)), f)


def main():
    from conftest import free_port

    cases = sys.argv[1:] or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; the cases: {', '.join(CASES)}")
    out = tempfile.mkdtemp(prefix="oktopk-repro-")
    try:
        mp.start_processes(rank_main, args=(2, free_port(), out, cases), nprocs=2, start_method="spawn")
        with open(os.path.join(out, "rank0")) as f:
            text = f.read()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(text, end="")
    return 1 if "REPRODUCED" in text else 0


if __name__ == "__main__":
    sys.exit(main())
