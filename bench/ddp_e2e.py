"""End to end: time to accuracy. Real DDP training over gloo with one
gradient-communication method, from the same seed, initialization and data
order for every method, until a step budget ends; rank 0 evaluates the
held-out 20% every ``--eval-every`` steps, outside the timed region, and
records when the accuracy first reaches ``--target``. What a user buys is not
a faster allreduce but a model that reaches its accuracy sooner, so this is
the figure to compare: training seconds to the target.

The model: ``mlp`` (default), a wide MLP on scikit-learn's 8×8 digits,
64 → ``--width`` → ``--width`` → 10 (width 4096: 17.1M parameters, nearly all
in one 4096×4096 matrix). Its step costs about one multiply-add per
parameter per image, so on a 2-core machine running 8 ranks the compute of a
step is a small fraction of a dense allreduce of 68 MB at 200 Mbit/s:
communication is most of a dense step, as on a real cluster training a
communication-bound model, and the methods differ where they claim to. It
also reaches 95% within a few dozen steps of 64 images (trained densely in
one process: 96.7% after 40 steps), so a run to a target is minutes, not
hours. ``cnn`` is the VGG-style CNN of examples/pytorch/cnn.py
(``--width 13``: 16.5M parameters), whose convolutions make its steps
compute-bound on such a machine (about a second of compute per step at P = 8,
one core per four ranks): kept for comparison with the earlier rows.
``fashion`` is a LeNet-style CNN (two 5×5 convolutions of 32 and 64
channels, each with 2×2 max pooling, then 1024 → ``--width`` → 10; width
512: 0.58M parameters) on Fashion-MNIST, real 28×28 photographs of clothing
in 10 classes, 60,000 for training and the official 10,000 held out, as
Debian's dataset-fashion-mnist ships them (``make deps-images``; nothing is
downloaded at run time): a model that is neither an MLP nor on 8×8 digits.
It is trained as CNNs are: SGD with momentum 0.9, its learning rate warmed
up linearly over ``--lr-warmup`` steps and decayed (cosine) to a tenth of
``--lr`` at the step budget, so the final accuracy is that of a settled
model, not of wherever a constant rate left it.
``charlm`` is the byte-level causal transformer of
examples/pytorch/charlm.py (``--width 192``: 1.89M parameters) on real
English text (Debian's fortunes, every tenth fortune held out), trained as
transformers are: AdamW (weight decay 0.01), a linear learning-rate warm-up
over ``--lr-warmup`` steps and cosine decay to a tenth of ``--lr`` at the
step budget, gradients clipped to norm 1. Its target is a held-out loss
(nats per byte, reached at or below it) and its accuracy is next-byte
accuracy.

Methods (``--method``):

- ``ddp``: plain DDP, gloo allreduce of every bucket.
- ``fp16``: torch's ``fp16_compress_hook`` (values in float16 on the wire).
- ``powersgd1``, ``powersgd4``: torch's ``powerSGD_hook`` at rank 1 and 4,
  error feedback and warm start on (its defaults), dense for the first
  ``--powersgd-start`` steps. torch's default ``start_powerSGD_iter`` is
  1,000, more than this whole run; its documentation suggests starting at
  10% of the training steps, which is what the default here (10 of a
  100-step budget) is. One bucket: powerSGD chains allreduces from future
  callbacks, and over gloo several buckets in flight reach the ranks'
  collectives in different orders (gloo fails with a size mismatch).
- ``oktopk``: ``oktopk_hook`` with ``OkTopkState(density=--density)``, the
  rest as a user gets it: two dense warm-up steps, then the measured choice
  between gloo's allreduce and sparse (``algorithm=None``; rank 0 prints a
  ``choice,`` line saying what it chose and why), τ = 64, τ′ = 32. Results
  from before that default (results/tta*, results/text*) ran
  ``algorithm="oktopk"``, which ``oktopk_oktopk`` names now.
- ``oktopk_nomc``: the same with ``momentum_correction=False``: the
  optimizer's momentum acts on the sparse average (the hook before momentum
  correction, oktopk.momentum). ``_nomc`` ends any oktopk method name to
  the same effect (``oktopk_oktopk_nomc``).
- ``oktopk_auto``: the same with ``algorithm="auto"`` (the library picks the
  algorithm per bucket and call from its cost model and the measured link).
- ``oktopk_quantized``, ``oktopk_float32``: the same with
  ``dense_compression="quantized"`` or ``None`` (which compressed dense path
  the measured choice weighs against float32 under an Adam-family
  optimizer; the default is bfloat16).
- ``oktopk_sparse_first``: the hook with ``sparse_after=0``, sparse measured
  against native from the first step after the warm-up (the default before
  the early 4-bit steps); ``oktopk_nosparse``: ``sparse=False``.
- ``oktopk_tensor_rounding``: the hook's defaults with the 4-bit path
  rounding as tensor operations (as on a GPU, and on the CPU before
  ``oktopk_quantize_blocks``), against ``oktopk``'s one-pass rounding in the
  library.
- ``oktopk_forced_bf16``, ``oktopk_forced_quantized``: the hook with every
  step after DDP's first two on that compressed dense path, whatever a
  step measures (``warmup_iters=--steps``,
  ``warmup_compression="bf16"`` or ``"quantized"``: DDP's first step in
  bfloat16, its second native, every later one on the path, the quantized
  residuals kept as ``dense_compression`` keeps them): the path's quality
  on a link where the measured choice keeps native (loopback). Their bytes
  per step are the path's over those later steps.
- ``oktopk_sched``: the same with ``density_schedule=(0.25,
  --sched-steps)``: the density starts at 25% and decays to ``--density``.
- ``oktopk_mask``, ``oktopk_clip``, ``oktopk_mask_clip``: the same with
  DGC's momentum factor masking (``momentum_masking=True``), its local
  gradient clipping (``local_clip_norm=--clip-norm``), or both, inside the
  momentum correction (results/sgd.md).
- ``oktopk_wmask``, ``oktopk_wmask_sched``: masking of the entries that
  left after waiting (``momentum_masking="waited"``), and the same with the
  density schedule of ``oktopk_sched`` (``oktopk_wmask_w10``: with 10 dense
  warm-up steps).
- ``oktopk_wN`` (e.g. ``oktopk_w10``): the same as ``oktopk`` with N dense
  warm-up steps (``warmup_iters=N``) instead of two: the evidence for the
  warm-up default. ``_q`` after it (``oktopk_wmask_w10_q``): the warm-up's
  steps after the first two in 4 bits (``warmup_compression="quantized"``).
- ``oktopk_dN`` (e.g. ``oktopk_d5``): the same as ``oktopk`` at density N%
  instead of ``--density``.
- ``oktopk_topka``, ``oktopk_gtopk``, ...: the same with that sparse
  algorithm (any of ``oktopk.ALGORITHMS`` but the dense ones).
  ``_int8`` or ``_int4`` after the algorithm (``oktopk_oktopk_int8``):
  its selected values sent as 8- or 4-bit codes with a scale per 32
  (``value_dtype="int8"`` or ``"int4"``).
- ``demo`` (charlm): ``oktopk.optim.DeMo`` instead of AdamW (its exchange
  over Ok-Topk, DDP's allreduce off), peak learning rate ``--demo-lr``
  on the same schedule, weight decay 0.01, the local gradient clipped.
  ``demo_int8`` (``demo_int4``, ``demo_bfloat16``): the same with its
  coefficients sent in that format (DeMo's ``value_dtype``).

Bytes per step are what one rank sends per step once the method compresses
(after its dense warm-up), averaged over the ranks: for oktopk the library's
own count over its sparse steps (its per-call stats, ``OkTopkState.bytes_sent``)
and quantized ones (``quantized_bytes_sent``: its frames), and the ring
formula's over the steps the measured choice sent densely (native, or bf16
at 2 bytes a value); for the dense ones the ring allreduce's 2n(P−1)/P words of 4 bytes
(fp16: 2 bytes); for powerSGD the same ring formula over the elements it
allreduces, torch's own count (``total_numel_after_compression``: P and Q
of every compressed matrix, (rows + cols) × rank, and every tensor left
uncompressed). ``run_bytes`` adds the dense warm-up steps (by the ring
formula) over the steps run.

Timing: rank 0 evaluates the initial model (step 0, where every curve
starts), then its clock runs from a barrier before the first step and stops
at a barrier after every ``--eval-every``-th step, before the evaluation; it
restarts when the evaluation's verdict has been broadcast. So training
seconds count every rank's steps, lazy setup inside them (oktopk's
communicator), and exclude evaluation. Time to target has the resolution of
the evaluation interval. With ``--stop-at-target`` every rank stops at the
first evaluation that reaches the target (the final columns are then at
that step).

``--method`` may name several methods, joined by commas: each runs from
the seed in turn in the same processes (the smoke run does this, saving an
interpreter start per method; the benchmark runs each in fresh processes).

Rank 0 prints a ``curve,`` line per evaluation and one ``row,`` line at
the end (tta_report.py's ``CURVE_HEADER`` and ``HEADER``); bench/ddp_e2e.sh
collects them and bench/tta_report.py reports them.

    bench/ddp_e2e.sh PYTHON OUTDIR     # every method on the emulated cluster
"""

import argparse
import gzip
import os
import re
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch"))
from charlm import CharTransformer, batch, fortunes_corpus, held_out_batch, lm_loss, lr_at  # noqa: E402
from cnn import VGGStyle, digits  # noqa: E402
from tta_report import HEADER  # noqa: E402

try:
    from oktopk.quantized import _library_rounds as LIBRARY_ROUNDS
except ImportError:  # the plugin is optional for the torch-only methods
    LIBRARY_ROUNDS = None
METHODS = ("ddp", "fp16", "powersgd1", "powersgd4", "oktopk", "oktopk_nomc", "oktopk_auto", "oktopk_sched", "oktopk_quantized", "oktopk_float32",
           "oktopk_mask", "oktopk_clip", "oktopk_mask_clip", "oktopk_wmask", "oktopk_wmask_sched", "oktopk_forced_bf16", "oktopk_forced_quantized", "demo",
           "demo_bfloat16", "demo_int8", "demo_int4", "oktopk_nosparse", "oktopk_sparse_first", "oktopk_tensor_rounding")
# DeMo's peak learning rate on charlm: the best of bench/adam_sim.py's sweep
# (results/text.md); its sign step moves every coordinate by the whole rate.
DEMO_LR = 3e-3


# Where Debian's dataset-fashion-mnist package puts the data set.
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


class WideMLP(nn.Module):
    """64 → width → width → 10 on the flattened 8×8 digits."""

    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x):
        return self.net(x)


class FashionCNN(nn.Module):
    """Two 5×5 convolutions (32 and 64 channels), each followed by 2×2 max
    pooling, then 1024 → width → 10, on 28×28 images (width 512: 0.58M
    parameters, nine tenths of them in the first linear layer)."""

    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, width), nn.ReLU(), nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.net(x)


def fashion_mnist(folder=FASHION_MNIST):
    """((train images, labels), (test images, labels)) of Fashion-MNIST: its
    own 60,000/10,000 split, images as float32 N×1×28×28 in [0, 1].
    FileNotFoundError saying which package to install when it is missing."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: install Debian's dataset-fashion-mnist package (make deps-images)")

    def idx(name, offset):  # an IDX file's payload, past its header of `offset` bytes
        with gzip.open(os.path.join(folder, name), "rb") as f:
            return torch.frombuffer(bytearray(f.read()[offset:]), dtype=torch.uint8)

    def split(prefix):
        y = idx(f"{prefix}-labels-idx1-ubyte.gz", 8).long()
        return idx(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28).float() / 255.0, y

    return split("train"), split("t10k")


def evaluate(model, x, y):
    """(accuracy %, mean cross-entropy) on held-out data (charlm: of every
    byte of the held-out windows)."""
    model.eval()
    with torch.no_grad():
        out = model(x).reshape(y.numel(), -1)
        y = y.reshape(-1)
        acc, loss = 100.0 * (out.argmax(1) == y).float().mean().item(), F.cross_entropy(out, y).item()
    model.train()
    return acc, loss


def reached_target(model, acc, loss, target):
    """Accuracy at or above the target; charlm's target is a held-out loss,
    reached at or below it."""
    return loss <= target if model == "charlm" else acc >= target


def warmup_of(method):
    """N of an ``oktopk_wN`` or ``oktopk_<algorithm>_wN`` method (N >= 2),
    else None."""
    m = re.fullmatch(r"oktopk(?:_.+)?_w(\d+)(?:_q)?(?:_nomc)?", method)
    return int(m.group(1)) if m and int(m.group(1)) >= 2 else None


def sparse_algorithms():
    """The library's sparse algorithms, which a method may name as
    oktopk_<algorithm> ("auto" is oktopk_auto's)."""
    import oktopk

    return [a for a in oktopk.ALGORITHMS if not a.startswith("dense_") and a != "auto"]


def algorithm_of(method):
    """The algorithm an ``oktopk_<algorithm>`` (or ``oktopk_<algorithm>_wN``)
    method names, else None."""
    method = re.sub(r"(_int[48])?(_w\d+)?(_nomc)?$", "", method)
    name = method[len("oktopk_"):] if method.startswith("oktopk_") else None
    return name if name in sparse_algorithms() else None


def value_dtype_of(method):
    """The value_dtype ("int8" or "int4") an ``oktopk_<algorithm>_int8`` or
    ``_int4`` method (optionally with _wN) names, else None."""
    m = re.fullmatch(r"oktopk_.+_(int[48])(_w\d+)?(_nomc)?", method)
    return m.group(1) if m and algorithm_of(method) is not None else None


def density_of(method):
    """N/100 of an ``oktopk_dN`` method (0 < N <= 100), else None."""
    m = re.fullmatch(r"oktopk_d(\d+)", method)
    return int(m.group(1)) / 100 if m and 0 < int(m.group(1)) <= 100 else None


def forced_path_of(method):
    """The compressed dense path an ``oktopk_forced_<path>`` method runs on
    every step after DDP's first two ("bf16" or "quantized"), else None."""
    return method[len("oktopk_forced_"):] if method in ("oktopk_forced_bf16", "oktopk_forced_quantized") else None


def ring_bytes(elements, world, width=4):
    """Bytes one rank sends in a ring allreduce of `elements` values."""
    return 2 * elements * width * (world - 1) / world


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}, or several joined by commas, run one after the other in these processes")
    ap.add_argument("--model", choices=("mlp", "cnn", "fashion", "charlm"), default="mlp")
    ap.add_argument("--width", type=int, default=None, help="mlp: hidden width (default 4096); cnn: width multiplier (default 13); fashion: hidden width (default 512); charlm: model dimension (default 192)")
    ap.add_argument("--steps", type=int, default=100, help="step budget")
    ap.add_argument("--target", type=float, default=95.0, help="held-out accuracy, percent (charlm: held-out loss, nats per byte)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--stop-at-target", action="store_true")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=None, help="SGD's (mlp, cnn, fashion; default 0.1) or AdamW's peak (charlm; default 0.002) learning rate")
    ap.add_argument("--lr-warmup", type=int, default=30, help="charlm, fashion: steps of linear learning-rate warm-up")
    ap.add_argument("--seq", type=int, default=64, help="charlm: bytes per window")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--powersgd-start", type=int, default=10, help="powerSGD's start_powerSGD_iter (at least 2)")
    ap.add_argument("--masking-steps", type=int, default=None,
                    help="the oktopk methods without a masking of their own: momentum_masking=(\"waited\", N), masking over the "
                         "first N steps with a sparse call (the default's window is oktopk.settings.AUTO_MASKING_STEPS)")
    ap.add_argument("--sched-steps", type=int, default=50, help="oktopk_sched: decay_steps of density_schedule=(0.25, N)")
    ap.add_argument("--clip-norm", type=float, default=4.0, help="oktopk_clip, oktopk_mask_clip: local_clip_norm (each rank's gradient of "
                    "each parameter clipped to norm clip-norm / sqrt(P))")
    ap.add_argument("--grad-clip", type=float, default=None, help="mlp, cnn, fashion: clip_grad_norm_ after backward to this norm, as "
                    "Trainer's max_grad_norm does, for every method (charlm always clips to 1)")
    ap.add_argument("--algorithm", default=None, help="oktopk methods: this algorithm on every step after the warm-up instead of the measured "
                    "choice (on loopback the choice keeps the native allreduce, so accuracy studies of the sparse path name one)")
    ap.add_argument("--demo-lr", type=float, default=DEMO_LR, help="demo: peak learning rate of DeMo's sign step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.eval_every < 1:
        ap.error(f"--steps ({args.steps}) and --eval-every ({args.eval_every}) must be positive")
    if args.powersgd_start < 2:
        ap.error(f"--powersgd-start must be at least 2 (powerSGD with error feedback starts after DDP's first steps), got {args.powersgd_start}")
    methods = args.method.split(",")
    for m in methods:
        m = m if m == "oktopk_nomc" else m.removesuffix("_nomc")
        if m not in METHODS and warmup_of(m) is None and density_of(m) is None and algorithm_of(m) is None:
            ap.error(f"--method {m!r} is none of {', '.join(METHODS)}, nor oktopk_wN (N >= 2 dense warm-up steps), nor oktopk_dN "
                     f"(density N%), nor oktopk_<algorithm> ({', '.join(sparse_algorithms())}), optionally with _int8 or _int4 and _wN")
    width = args.width if args.width is not None else {"mlp": 4096, "cnn": 13, "fashion": 512, "charlm": 192}[args.model]
    if args.lr is None:
        args.lr = 0.002 if args.model == "charlm" else 0.1

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if args.model == "charlm":
        train_text, held = fortunes_corpus()
        data = (train_text, held_out_batch(held, args.seq))
    elif args.model == "fashion":
        data = fashion_mnist()
    else:
        data = digits(args.seed)
    for method in methods:
        train(method, args, width, data)
    dist.destroy_process_group()
    exit_now()


def exit_now():
    """End the rank's process once its output is written, without the
    interpreter's finalization: there a gloo worker thread releasing a
    collective DDP issued during backward can abort the process ("terminate
    called without an active exception", torch's, with or without the
    hook; docs/pytorch-details.md), about one run in 30, which would fail
    the run after its figures were written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(method, args, width, data):
    """One method's run from the seed; rank 0 prints its lines."""
    rank, world = dist.get_rank(), dist.get_world_size()
    charlm = args.model == "charlm"
    if charlm:
        train_text, (xte, yte) = data
    else:
        (xtr, ytr), (xte, yte) = data
    torch.manual_seed(args.seed)
    net = {"mlp": lambda: WideMLP(width), "cnn": lambda: VGGStyle(width), "fashion": lambda: FashionCNN(width), "charlm": lambda: CharTransformer(width, seq=args.seq)}[args.model]()
    model = DDP(net, bucket_cap_mb=1024 if method.startswith("powersgd") else 25)
    state, warmup, density = None, 0, 1.0
    if method == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(method[len("powersgd"):]), start_powerSGD_iter=args.powersgd_start
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        warmup = args.powersgd_start
    elif method.startswith("oktopk"):
        from oktopk import OkTopkState, oktopk_hook, quantized
        from oktopk.choice import BF16, NATIVE
        from oktopk.settings import NATIVE_WARMUP_ITERS

        # oktopk_tensor_rounding: the 4-bit path rounding with tensor
        # operations, as before the library's one-pass rounding; every
        # other method, the library's (restored: methods share a process).
        quantized._library_rounds = LIBRARY_ROUNDS if method != "oktopk_tensor_rounding" else (lambda *settings: False)

        kwargs = {"algorithm": "auto"} if method == "oktopk_auto" else {}
        if method in ("oktopk_quantized", "oktopk_float32"):  # under AdamW: the dense path measured against float32
            kwargs["dense_compression"] = "quantized" if method == "oktopk_quantized" else None
        if args.algorithm is not None:
            kwargs["algorithm"] = args.algorithm
        if algorithm_of(method) is not None:
            kwargs["algorithm"] = algorithm_of(method)
        if value_dtype_of(method) is not None:
            kwargs["value_dtype"] = value_dtype_of(method)
        if method.endswith("_nomc"):
            kwargs["momentum_correction"] = False
        if method == "oktopk_nosparse":  # the measured choice with the 4-bit path in sparse's place (sparse=False)
            kwargs["sparse"] = False
        if method == "oktopk_sparse_first":  # sparse measured from the first step after the warm-up (sparse_after=0)
            kwargs["sparse_after"] = 0
        if method.removesuffix("_nomc") in ("oktopk_sched", "oktopk_wmask_sched"):
            kwargs["density_schedule"] = (0.25, args.sched_steps)
        if method in ("oktopk_mask", "oktopk_mask_clip"):
            kwargs["momentum_masking"] = True
        if method == "oktopk_wmask" or method.startswith("oktopk_wmask_"):
            kwargs["momentum_masking"] = "waited"
        if args.masking_steps is not None and "momentum_masking" not in kwargs and not method.endswith("_nomc"):
            kwargs["momentum_masking"] = ("waited", args.masking_steps)
        if method in ("oktopk_clip", "oktopk_mask_clip"):
            kwargs["local_clip_norm"] = args.clip_norm
        if warmup_of(method) is not None:
            kwargs["warmup_iters"] = warmup_of(method)
        if forced_path_of(method) is not None:  # the whole run a warm-up on the path
            kwargs["warmup_iters"] = max(args.steps, 2)
            kwargs["warmup_compression"] = forced_path_of(method)
        if method.endswith("_q"):
            kwargs["warmup_compression"] = "quantized"
        density = density_of(method) or args.density
        state = OkTopkState(density=density, **kwargs)
        model.register_comm_hook(state, oktopk_hook)
        warmup = state.warmup_iters
    peak_lr = args.lr
    if method.startswith("demo"):
        import oktopk.optim

        value_dtype = method[len("demo_"):] or "float32"
        opt = oktopk.optim.DeMo(model, lr=args.demo_lr, weight_decay=0.01, value_dtype=value_dtype)
        peak_lr = args.demo_lr
    elif charlm:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())

    if charlm:  # this rank's windows, the same for every method
        windows = torch.Generator().manual_seed(args.seed * 1000 + rank)
    else:
        shard = torch.arange(rank, len(ytr), world)[: len(ytr) // world]  # same step count on every rank
        per_epoch = len(shard) // args.batch_size
        if per_epoch < 1:
            raise SystemExit(f"ddp_e2e.py: {len(shard)} images per rank are fewer than a batch of {args.batch_size}")
    reached = None  # (train seconds, step) of the first evaluation at or above the target
    acc = loss = float("nan")
    flag = torch.zeros(1)
    train_s, step = 0.0, 0
    warmup_sent = 0.0  # what a compressed warm-up's steps sent (warmup_compression)
    if rank == 0:  # where every method starts from, for the plot
        acc0, loss0 = evaluate(model.module, xte, yte)
        print(f"curve,{method},0,0.000,{acc0:.2f},{loss0:.4f}", flush=True)
    dist.barrier()
    start = time.perf_counter()
    while step < args.steps:
        if charlm or args.model == "fashion":  # warm-up and cosine decay
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, peak_lr, args.lr_warmup)
        if charlm:
            out = lm_loss(model, *batch(train_text, args.batch_size, args.seq, windows))
        else:
            epoch, i = divmod(step, per_epoch)
            if i == 0:
                perm = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))]
            idx = perm[i * args.batch_size : (i + 1) * args.batch_size]
            out = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        out.backward()
        if charlm or args.grad_clip:
            # A framework's clip after backward (Trainer's max_grad_norm=1.0).
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or 1.0)
        opt.step()
        step += 1
        if step == warmup and method.startswith("oktopk"):
            warmup_sent = float(state.quantized_bytes_sent)
        if step % args.eval_every == 0 or step == args.steps:
            dist.barrier()  # every rank has finished the step
            train_s += time.perf_counter() - start
            if rank == 0:
                acc, loss = evaluate(model.module, xte, yte)
                print(f"curve,{method},{step},{train_s:.3f},{acc:.2f},{loss:.4f}", flush=True)  # CURVE_HEADER
                if reached is None and reached_target(args.model, acc, loss, args.target):
                    reached = (train_s, step)
                flag.fill_(1.0 if reached is not None and args.stop_at_target else 0.0)
            dist.broadcast(flag, 0)
            if flag.item():
                break
            start = time.perf_counter()

    if method.startswith("oktopk") and step < warmup:  # stopped within the warm-up: what it sent so far
        warmup_sent = float(state.quantized_bytes_sent)
    # Bytes one rank sends per step once the method compresses, averaged
    # over the ranks (see the docstring).
    dense = ring_bytes(params, world)
    compressed = max(step - warmup, 0)
    forced = forced_path_of(method)
    if method == "ddp":
        per_step = dense
    elif method == "fp16":
        per_step = ring_bytes(params, world, 2)
    elif method.startswith("powersgd"):
        per_step = ring_bytes(state.total_numel_after_compression / compressed, world) if compressed else float("nan")
    elif method.startswith("demo"):  # the library's count of every exchange, indices included
        sent = torch.tensor([float(opt.bytes_sent)], dtype=torch.float64)
        dist.all_reduce(sent)
        per_step = sent.item() / world / step
        opt.close()
    elif forced is not None:  # the path's steps after DDP's first two: the library's count of its frames, or the ring formula
        sent = torch.tensor([warmup_sent], dtype=torch.float64)
        dist.all_reduce(sent)
        on_path = max(step - NATIVE_WARMUP_ITERS, 0)
        if forced == "bf16":
            per_step = ring_bytes(params, world, 2)
        else:
            per_step = sent.item() / world / on_path if on_path else float("nan")
    else:
        sent = float(state.bytes_sent + state.quantized_bytes_sent) - warmup_sent
        if state.choice is not None:  # the measured choice's native and bf16 steps, by the ring formula
            sent += state.choice["steps"]["native"] * dense + state.choice["steps"]["bf16"] * ring_bytes(params, world, 2)
        sent = torch.tensor([sent], dtype=torch.float64)
        dist.all_reduce(sent)
        per_step = sent.item() / world / compressed if compressed else float("nan")
    warmup_sent = torch.tensor([warmup_sent], dtype=torch.float64)
    dist.all_reduce(warmup_sent)
    bf16_warmup = 0
    if state is not None and getattr(state, "warmup_compression", None) is not None:  # a compressed warm-up: DDP's first step in bfloat16, its second native
        paths = [state.warmup_path(s) for s in range(min(step, state.warmup_iters))]
        native_warmup, bf16_warmup = paths.count(NATIVE), paths.count(BF16)
    else:
        native_warmup = min(step, warmup)
    run_bytes = (native_warmup * dense + bf16_warmup * ring_bytes(params, world, 2) + warmup_sent.item() / world
                 + (compressed * per_step if compressed else 0.0))
    if rank == 0:
        t_target, s_target = reached if reached is not None else (float("nan"), float("nan"))
        row = {
            "method": method, "model": args.model, "P": world, "params": params, "density": f"{density:g}",
            "warmup_steps": warmup, "steps": args.steps, "batch_per_rank": args.batch_size, "lr": f"{peak_lr:g}", "target": f"{args.target:g}",
            "eval_every": args.eval_every, "time_to_target_s": f"{t_target:.3f}", "steps_to_target": s_target,
            "train_s": f"{train_s:.3f}", "final_step": step, "final_accuracy": f"{acc:.2f}", "final_loss": f"{loss:.4f}",
            "ms_per_step": f"{1000 * train_s / step:.1f}", "bytes_per_step": f"{per_step:.0f}", "run_bytes": f"{run_bytes:.0f}",
        }
        assert ",".join(row) == HEADER, "the row's fields are tta_report.HEADER's"
        print("row," + ",".join(str(v) for v in row.values()), flush=True)
    if method.startswith("oktopk"):
        if rank == 0:
            print(f"momentum,{method},{state.momentum_status}", flush=True)
        if rank == 0 and state.choice is not None:
            c = state.choice
            paths = list(c["steps"])  # native, sparse and the compressed dense paths (oktopk.choice)
            print(f"choice,{method},{c['path']},{c['candidate']}," + ",".join(f"{p}:{c[p + '_ms_per_step']}" for p in paths) + ","
                  + ",".join(f"{p}:{c['steps'][p]}" for p in paths) + f",{c['reason']}", flush=True)
        state.close()


if __name__ == "__main__":
    main()
