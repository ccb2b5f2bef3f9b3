"""Exploration of sparse training with Adam, in one process: P simulated
workers, each with its own batch, gradient and residual, reduced by
Ok-Topk's rule (each worker's exact local top-k of gradient + residual,
summed, the exact global top-k of the sum kept, the average delivered; a
residual loses exactly its entries that were selected locally and kept
globally, Algorithm 2 of the paper), on the byte-level transformer of
examples/pytorch/charlm.py. No library, no processes: it isolates what the
optimizer does with sparse, bursty gradients, quickly enough to compare
many variants. The real runs are bench/ddp_e2e.py's.

    python bench/adam_sim.py --variant dense,plain,frozen --steps 400

Variants: see VARIANTS. Prints ``sim,variant,step,held_out_loss`` lines;
with ``--shares``, at the end, the share of each tensor's entries the
global selection kept per sparse step (``share,variant,tensor,numel,share``).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from charlm import CharTransformer, batch, fortunes_corpus, held_out_loss, lm_loss, lr_at  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugins", "pytorch"))
from oktopk.transforms import ChunkedDCT, hadamard_matrix, hadamard_rotate, rotation_signs  # noqa: E402

VARIANTS = {
    # What each variant changes from AdamW on Ok-Topk's result (defaults in
    # run's cfg): v, Adam's second moment: "adam" (updated by what arrives),
    # "frozen" (after the dense steps), "local" (from every worker's dense
    # local gradient, averaged every step) or "local_sync" (every
    # --sync-every steps); precond "scaled" (select and keep the residual
    # in Adam's preconditioned space) or "score" (select by it only);
    # small_dense (1-D tensors averaged densely); per_tensor (each tensor
    # its share of k); momentum (reduce each worker's momentum, as 1-bit
    # Adam does); residual_decay 0 (no error feedback); clip; onebit (not
    # top-k: every entry's sign times its tensor's mean magnitude, with
    # error feedback, as 1-bit Adam sends; density ignored).
    "dense": dict(sparse=False),
    "plain": dict(sparse=True),
    "frozen": dict(sparse=True, v="frozen"),
    "frozen_small_dense": dict(sparse=True, v="frozen", small_dense=True),
    "localv": dict(sparse=True, v="local"),
    "localv_sync": dict(sparse=True, v="local_sync"),
    "plain_noclip": dict(sparse=True, clip=False),
    "frozen_precond": dict(sparse=True, v="frozen", precond="scaled"),
    "plain_precondsel": dict(sparse=True, precond="score"),
    "pertensor": dict(sparse=True, per_tensor=True),
    "frozen_momentum": dict(sparse=True, v="frozen", momentum=True, clip=False),
    "dense_frozen": dict(sparse=False, v="frozen"),
    "noef": dict(sparse=True, residual_decay=0.0),
    "frozen_precond_pertensor": dict(sparse=True, v="frozen", precond="scaled", per_tensor=True),
    "onebit": dict(sparse=True, onebit=True),
    "onebit_frozen": dict(sparse=True, v="frozen", onebit=True),
    # Bounded staleness: every flush_every sparse steps the whole residual
    # is sent densely with that step's result (the step reduces
    # gradient + residual densely), so no entry waits longer.
    "flush10": dict(sparse=True, flush_every=10),
    "flush4": dict(sparse=True, flush_every=4),
    # Not top-k: every entry quantized to quant_bits (2^bits - 1 levels,
    # symmetric, round to nearest) in blocks of quant_block sharing one
    # 16-bit scale (the block's largest magnitude), as a quantized
    # reduce-scatter and allgather send it (ZeRO++'s qgZ): each worker
    # quantizes gradient + its residual and keeps the error (error
    # feedback); the owner of each block quantizes the average + its own
    # residual again for the allgather and keeps that error too. Bits per
    # value: quant_bits + 16 / quant_block (density ignored).
    "q4": dict(sparse=True, quant_bits=4, quant_block=64),
    "q3": dict(sparse=True, quant_bits=3, quant_block=64),
    "q3_b128": dict(sparse=True, quant_bits=3, quant_block=128),
    "q2": dict(sparse=True, quant_bits=2, quant_block=128),
    "q3_noef": dict(sparse=True, quant_bits=3, quant_block=64, residual_decay=0.0),
    # Rotated quantization (THC): each block of quant_block entries is first
    # turned by a randomized Hadamard rotation (±1 signs from a seed every
    # worker shares, then the orthonormal Hadamard matrix), which spreads
    # a block's outliers over all its entries, then rounded stochastically
    # (unbiased) to 2^bits evenly spaced levels spanning ±scale; both
    # errors (worker's and owner's) are kept, in the original space.
    "q4_rot": dict(sparse=True, quant_bits=4, quant_block=128, rotate=True),
    "q3_rot": dict(sparse=True, quant_bits=3, quant_block=128, rotate=True),
    "q2_rot": dict(sparse=True, quant_bits=2, quant_block=128, rotate=True),
    "q3_rot_nearest": dict(sparse=True, quant_bits=3, quant_block=128, rotate=True, stochastic=False),
    "q2_rot_nearest": dict(sparse=True, quant_bits=2, quant_block=128, rotate=True, stochastic=False),
    "q3_sr": dict(sparse=True, quant_bits=3, quant_block=128, stochastic=True),
    # Nearest rounding on every code (2^bits levels, no zero), and a scale
    # clipped to a multiple of the block's RMS (after a rotation a block is
    # near-Gaussian: the multiples are near the Lloyd-Max quantizers' outer
    # levels, 2.0 sigma for 8 levels, 1.5 for 4).
    "q3_full": dict(sparse=True, quant_bits=3, quant_block=128, quant_levels="full", stochastic=False),
    "q3_rot_full_clip": dict(sparse=True, quant_bits=3, quant_block=128, rotate=True, stochastic=False, quant_levels="full", quant_clip=2.0),
    "q2_rot_full_clip": dict(sparse=True, quant_bits=2, quant_block=128, rotate=True, stochastic=False, quant_levels="full", quant_clip=1.5),
    "q3_full_clip": dict(sparse=True, quant_bits=3, quant_block=128, stochastic=False, quant_levels="full", quant_clip=2.0),
    # DeMo (Peng, Quesnelle, Kingma 2024): no Adam. Each worker keeps its
    # own momentum with the learning rate folded in, d = 0.999 d + lr g
    # (its local gradient, clipped), takes the orthonormal DCT-II of d in
    # chunks (64x64 blocks of a matrix, 64-long pieces of a vector), selects
    # the top demo_topk coefficients of each chunk and removes what it sends
    # from d; the update is p = p (1 - lr wd) - lr sign(IDCT(reduced)).
    # "allgather": the public code's exchange, each coefficient averaged
    # over the workers that sent it. "oktopk": Ok-Topk's rule over all
    # coefficients (the sum of the selections, its global top-k kept,
    # divided by P; a worker's coefficient the global selection drops stays
    # in its momentum); "oktopk_mean": the same, each kept coefficient
    # averaged over its contributors instead of divided by P.
    "demo": dict(sparse=True, demo="allgather", warmup=0),
    "demo_ok": dict(sparse=True, demo="oktopk", warmup=0),
    "demo_ok_mean": dict(sparse=True, demo="oktopk_mean", warmup=0),
    "demo_ok_t64": dict(sparse=True, demo="oktopk", demo_topk=64, warmup=0),
    "demo_t64": dict(sparse=True, demo="allgather", demo_topk=64, warmup=0),
    "demo_ok_mean_t64": dict(sparse=True, demo="oktopk_mean", demo_topk=64, warmup=0),
    "demo_ok_t128": dict(sparse=True, demo="oktopk", demo_topk=128, warmup=0),
}


def quantize(x, bits, block, levels="sym", clip=None):
    """x (..., n) rounded to nearest per block of ``block`` entries, scaled
    by the block's largest magnitude (itself rounded to bfloat16, as it
    travels), or with ``clip`` by at most clip times the block's root mean
    square (what lies beyond is clamped; error feedback keeps the rest).
    ``levels``: "sym", 2^bits - 1 symmetric levels, zero among them;
    "full", 2^bits evenly spaced levels from -scale to +scale (every code
    used, no zero)."""
    n = x.shape[-1]
    pad = (-n) % block
    xb = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, block)
    scale = xb.abs().amax(-1, keepdim=True)
    if clip is not None:
        scale = torch.minimum(scale, clip * xb.pow(2).mean(-1, keepdim=True).sqrt())
    scale = scale.bfloat16().float().clamp_min(1e-30)
    if levels == "full":
        top = 2**bits - 1
        t = ((xb / scale).clamp(-1, 1) + 1) * (top / 2)
        q = (t.round() * (2 / top) - 1) * scale
    else:
        half = 2 ** (bits - 1) - 1  # levels -half..half
        q = (xb / scale * half).round().clamp(-half, half) * scale / half
    return q.reshape(*x.shape[:-1], -1)[..., :n]


def quantize_stochastic(x, bits, block, gen):
    """x (..., n) rounded stochastically (unbiased) to 2^bits evenly spaced
    levels from -scale to +scale per block, scale the block's largest
    magnitude (rounded to bfloat16, as it travels)."""
    n = x.shape[-1]
    xb = torch.nn.functional.pad(x, (0, (-n) % block)).reshape(*x.shape[:-1], -1, block)
    top = 2**bits - 1
    scale = xb.abs().amax(-1, keepdim=True).bfloat16().float().clamp_min(1e-30)
    # bfloat16 may round the scale below the largest magnitude: clamp.
    t = ((xb / scale).clamp(-1, 1) + 1) * (top / 2)
    q = (t + torch.rand(t.shape, generator=gen)).floor().clamp(0, top)
    return (q * (2 / top) - 1).mul(scale).reshape(*x.shape[:-1], -1)[..., :n]


def topk_mask(x, k, bounds=None):
    """The k largest |x|; with bounds (tensor boundaries), the density k/len
    of each tensor's entries."""
    mask = torch.zeros_like(x, dtype=torch.bool)
    if bounds is None:
        mask[torch.topk(x.abs(), k, sorted=False).indices] = True
        return mask
    for a, b in zip(bounds[:-1], bounds[1:]):
        kt = max(1, round(k * (b - a) / len(x)))
        mask[a + torch.topk(x[a:b].abs(), kt, sorted=False).indices] = True
    return mask


def run(name, args, data):
    cfg = dict(sparse=True, v="adam", small_dense=False, clip=True, precond=None, per_tensor=False, momentum=False, residual_decay=1.0, onebit=False,
               flush_every=0, quant_bits=0, quant_block=0, rotate=False, stochastic=None, quant_levels="sym", quant_clip=None, demo=None, demo_topk=32, warmup=args.warmup) | VARIANTS[name]
    if cfg["stochastic"] is None:
        cfg["stochastic"] = cfg["rotate"]
    train_text, held = data
    label = name + (f"_lr{args.lr:g}" if args.lr != 2e-3 else "") + (f"_s{args.seed}" if args.seed else "")
    torch.manual_seed(args.seed)
    model = CharTransformer(args.dim, args.layers, seq=args.seq)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    small = torch.cat([torch.full((s,), p.dim() <= 1) for p, s in zip(params, sizes)])
    selectable = ~small if cfg["small_dense"] else torch.ones(n, dtype=torch.bool)
    k = max(1, int(args.density * int(selectable.sum())))
    residual = torch.zeros(args.P, n)
    owner_residual = torch.zeros(n)  # the second quantization's error, kept by each block's owner
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    bounds_all = bounds
    bounds = bounds if cfg["per_tensor"] else None
    gens = [torch.Generator().manual_seed(1000 + w + 100 * args.seed) for w in range(args.P)]
    rounding = torch.Generator().manual_seed(7 + args.seed)
    if cfg["rotate"]:
        h = hadamard_matrix(cfg["quant_block"])
        padded = n + (-n) % cfg["quant_block"]
        signs = rotation_signs(padded, 99)
    if cfg["demo"]:
        dct = ChunkedDCT([p.shape for p in params])
        delta = torch.zeros(args.P, n)  # every worker's momentum, in DCT coefficients (the transform is orthonormal)
        k_demo = sum(nc * min(cfg["demo_topk"], cl) for _, nc, cl in dct.blocks())
        print(f"# {label}: {k_demo} coefficients selected per worker ({k_demo / n:.4f} of {n})", flush=True)
    m = torch.zeros(n)
    v = torch.zeros(n)
    vlocal = torch.zeros(n)
    kept = torch.zeros(n)  # times each entry was kept globally
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    vt = 0  # the last step that updated v
    print(f"sim,{label},0,{held_out_loss(model, held, args.seq):.4f}", flush=True)
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.lr_warmup)
        grads = torch.empty(args.P, n)
        for w in range(args.P):
            model.zero_grad()
            lm_loss(model, *batch(train_text, args.batch_size, args.seq, gens[w])).backward()
            grads[w] = torch.cat([p.grad.reshape(-1) for p in params])
        if cfg["demo"]:
            demo_step(cfg, args, lr, grads, delta, dct, params, sizes, k_demo, wd=0.01)
            if (step + 1) % args.eval_every == 0:
                print(f"sim,{label},{step + 1},{held_out_loss(model, held, args.seq):.4f}", flush=True)
            continue
        dense_phase = step < cfg["warmup"]
        flush = cfg["flush_every"] and not dense_phase and (step - cfg["warmup"] + 1) % cfg["flush_every"] == 0
        if flush:
            g = (grads + residual).mean(0)
            residual = torch.zeros_like(residual)
        elif not cfg["sparse"] or dense_phase:
            g = grads.mean(0)
        elif cfg["quant_bits"] and (cfg["rotate"] or cfg["stochastic"] or cfg["quant_levels"] != "sym" or cfg["quant_clip"]):
            acc = grads + residual
            turn = (lambda x: hadamard_rotate(torch.nn.functional.pad(x, (0, padded - n)), signs, h)) if cfg["rotate"] else (lambda x: x)
            back = (lambda x: hadamard_rotate(x, signs, h, inverse=True)[..., :n]) if cfg["rotate"] else (lambda x: x)
            nearest = lambda x: quantize(x, cfg["quant_bits"], cfg["quant_block"], cfg["quant_levels"], cfg["quant_clip"])  # noqa: E731
            sent = quantize_stochastic(turn(acc), cfg["quant_bits"], cfg["quant_block"], rounding) if cfg["stochastic"] else nearest(turn(acc))
            residual = (acc - back(sent)) * cfg["residual_decay"]
            avg = sent.mean(0) + turn(owner_residual)
            gq = quantize_stochastic(avg, cfg["quant_bits"], cfg["quant_block"], rounding) if cfg["stochastic"] else nearest(avg)
            owner_residual = back(avg - gq) * cfg["residual_decay"]
            g = back(gq)
        elif cfg["quant_bits"]:
            acc = grads + residual
            sent = quantize(acc, cfg["quant_bits"], cfg["quant_block"])
            residual = (acc - sent) * cfg["residual_decay"]
            avg = sent.mean(0) + owner_residual
            g = quantize(avg, cfg["quant_bits"], cfg["quant_block"])
            owner_residual = (avg - g) * cfg["residual_decay"]
        else:
            # The preconditioner of Adam's current (or frozen) second moment:
            # "scaled" reduces the preconditioned gradient (residual kept in
            # that space), "score" only selects by it.
            scale = 1.0 / ((v / (1 - b2 ** (vt + 1))).sqrt() + eps) if cfg["precond"] else torch.ones(n)
            space = scale if cfg["precond"] == "scaled" else torch.ones(n)
            score = scale if cfg["precond"] == "score" else torch.ones(n)
            acc = (grads * space if not cfg["momentum"] else b1 * m + (1 - b1) * grads) + residual
            if cfg["onebit"]:
                sent = torch.empty_like(acc)
                for a, b in zip(bounds_all[:-1], bounds_all[1:]):
                    sent[:, a:b] = acc[:, a:b].sign() * acc[:, a:b].abs().mean(1, keepdim=True)
                residual = acc - sent
                g = sent.mean(0) / space
            sel = torch.zeros_like(acc, dtype=torch.bool)
            for w in range(args.P if not cfg["onebit"] else 0):
                idx = selectable.nonzero().squeeze(1)
                sel[w, idx[topk_mask((acc[w] * score)[idx], k, bounds)]] = True
            summed = (acc * sel).sum(0)
            keep = torch.zeros(n, dtype=torch.bool)
            sidx = selectable.nonzero().squeeze(1)
            if not cfg["onebit"]:
                keep[sidx[topk_mask((summed * score)[sidx], k, bounds)]] = True
                kept += keep
                g = torch.where(keep, summed, 0.0) / args.P / space  # back to the gradient's space, as the hook returns it
                residual = torch.where(sel & keep, 0.0, acc) * cfg["residual_decay"]
            if cfg["small_dense"]:
                g = torch.where(small, acc.mean(0), g)
                residual[:, small] = 0.0
        if cfg["clip"]:
            norm = g.norm()
            if norm > 1.0:
                g = g / norm
        t = step + 1
        pflat = torch.cat([p.detach().reshape(-1) for p in params])
        if cfg["momentum"] and not dense_phase:
            m.copy_(g)  # the reduced momentum itself
        else:
            m.lerp_(g, 1 - b1)
        mode = cfg["v"]
        if mode == "adam" or dense_phase:
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            vt = step
        elif mode == "local":  # every worker's local squares, averaged every step
            v.mul_(b2).add_((grads * grads).mean(0), alpha=1 - b2)
        elif mode == "local_sync":  # averaged every sync_every steps
            vlocal.mul_(b2).add_((grads * grads).mean(0), alpha=1 - b2)
            if step % args.sync_every == 0:
                v.copy_(vlocal)
        # frozen: v stays as the dense warm-up left it, bias-corrected at its step
        bc2 = 1 - b2 ** (vt + 1 if mode == "frozen" else t)
        if mode in ("local", "local_sync") and not dense_phase:
            bc2 = 1 - b2**t
        pflat.mul_(1 - lr * wd)
        pflat.addcdiv_(m, (v / bc2).sqrt().add_(eps), value=-lr / (1 - b1**t))
        if mode == "local_sync" and dense_phase:
            vlocal.copy_(v)
        at = 0
        with torch.no_grad():
            for p, s in zip(params, sizes):
                p.copy_(pflat[at : at + s].view_as(p))
                at += s
        if (step + 1) % args.eval_every == 0:
            print(f"sim,{label},{step + 1},{held_out_loss(model, held, args.seq):.4f}", flush=True)
    if args.shares and cfg["sparse"]:
        at, sparse_steps = 0, max(1, args.steps - args.warmup)
        for (tensor, _), s in zip(model.named_parameters(), sizes):
            print(f"share,{name},{tensor},{s},{kept[at : at + s].mean().item() / sparse_steps:.5f}", flush=True)
            at += s


def demo_step(cfg, args, lr, grads, delta, dct, params, sizes, k, wd):
    """One DeMo step of every worker (see VARIANTS), in place on the
    parameters and on ``delta`` (P x n coefficients)."""
    if cfg["clip"]:  # each worker's own gradient, as clip_grad_norm_ without a gradient allreduce
        grads = grads / grads.norm(dim=1, keepdim=True).clamp_min(1.0)
    delta.mul_(0.999).add_(dct.apply(grads), alpha=lr)
    sel = torch.zeros_like(delta, dtype=torch.bool)
    for at, nc, cl in dct.blocks():
        block = delta[:, at : at + nc * cl].reshape(args.P, nc, cl)
        idx = torch.topk(block.abs(), min(cfg["demo_topk"], cl), dim=-1, sorted=False).indices
        sel[:, at : at + nc * cl].view(args.P, nc, cl).scatter_(-1, idx, True)
    summed = (delta * sel).sum(0)
    count = sel.sum(0)
    if cfg["demo"] == "allgather":
        reduced = summed / count.clamp_min(1)
        delta.masked_fill_(sel, 0.0)
    else:
        keep = torch.zeros_like(summed, dtype=torch.bool)
        keep[torch.topk(summed.abs(), k, sorted=False).indices] = True
        keep &= count > 0
        reduced = torch.where(keep, summed / (count.clamp_min(1) if cfg["demo"] == "oktopk_mean" else args.P), 0.0)
        delta.masked_fill_(sel & keep, 0.0)
    update = dct.apply(reduced, inverse=True).sign()
    at = 0
    with torch.no_grad():
        for p, s in zip(params, sizes):
            p.mul_(1 - lr * wd).sub_(update[at : at + s].view_as(p), alpha=lr)
            at += s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True, help=",".join(VARIANTS))
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20, help="dense steps first")
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="model initialization and batches (0: the runs in results/)")
    ap.add_argument("--shares", action="store_true", help="print the share of each tensor kept per sparse step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = fortunes_corpus()
    for name in args.variant.split(","):
        run(name, args, data)


if __name__ == "__main__":
    main()
