"""Will oktopk help this cluster? A step-time model of data-parallel
training, and ``python -m oktopk.plan``, which prints it for each method.

One step, P ranks of R per node, n parameters in DDP's buckets:

    step = compute + device work + the link time backward does not hide

with one collective call per DDP bucket, each predicted by the library's
own cost model: the terms ``algorithm="auto"`` chooses by
(``oktopk_predict_call``: rounds x latency + bytes x time per byte + bytes
of memory passes x time per byte of a pass, counted from the library's
implementations). The calls hide under backward as DDP's buckets allow:
backward (2/3 of the compute) hands the buckets over evenly, the last
layers' first, and their calls run one at a time, so a bucket's call
starts when backward has produced it and the previous call is done; what
runs past the end of backward is exposed. ``overlap`` scales the window
(0: nothing hides, as when the reduction runs after backward). A model of
one bucket hides nothing; nor does DeMo, whose exchange runs in the
optimizer's step. Where the ranks compute on the cores the calls' passes
run on (``shared_cores``: CPUs), the passes and the host's per-byte work
are paid in full and only the link's rounds and bytes hide. Nothing here
re-derives an algorithm's cost: the dense paths and PowerSGD are the
library's ring on their bytes, DeMo is Ok-Topk on its coefficients.

Two link levels, one communicator. The hook runs one flat communicator over
all P ranks (so does DDP's native allreduce in gloo; NCCL builds rings over
the nodes in the same way), so a call is modelled on the slowest link its
schedule crosses: with one node, the intra-node link; otherwise the
inter-node latency, and the node's network bandwidth shared by the ranks of
a node that cross it at once. A ring's schedule crosses with one rank per
node per step (ranks are numbered node by node), so it gets the whole
network link; schedules that talk to every peer at once (Ok-Topk's split
and reduce and allgatherv, Rabenseifner, SparCML's split) get a 1/R share
of it. The intra-node traffic runs meanwhile on the faster level and is not
on the critical path. A hierarchical schedule (reduce inside the node, then
exchange across nodes) would move R times fewer bytes over the network for
the sparse schedules; the library does not run one, and the model predicts
what runs.

Selection is the library's memory passes (the γ term); on a GPU it is a
pass over the device's memory (``--select-gbps``), on the host a pass over
the host's. Methods:

- ``dense``: the native allreduce, float32 (the ring);
- ``bf16``: the same in bfloat16, half the bytes;
- ``quantized``: ``oktopk.quantized``, 4-bit values with a scale per block,
  its all-to-all and allgather the ring's bytes at that width;
- ``oktopk``, ``topka``, ``topkdsa``, ``gtopk``, ``gaussiank``, and
  ``auto`` (whatever the model chooses per bucket), each selected entry
  priced as its frame carries it: its index coded as a gap, its value in
  ``--values`` (float32 by default; float16, bfloat16, int8 or int4 for
  the algorithms that take them, the library's
  ``oktopk_algorithm_takes_reduced_values``; the others send float32);
- ``powersgd``: rank r, two allreduces of (rows + cols) x r per matrix, and
  passes over the gradient for its products;
- ``demo``: ``oktopk.optim.DeMo``, Ok-Topk on the DCT coefficients of the
  momentum at the blocks' density, plus the transforms' passes.

Bytes are per rank per step, what one rank sends on the critical path.
"""

import argparse
import ctypes
import itertools
import math
import os
import re
import sys
from collections import namedtuple

from . import _lib, choice, quantized
from .optim import CHUNK, TOPK
from .settings import DEFAULT_WARMUP_ITERS, DEFAULTS, default_of

# torch DDP's default bucket_cap_mb: each bucket is one collective call.
DDP_BUCKET_BYTES = 25 * 2**20
# The share of the compute in backward, which bucketed communication can
# overlap: backward costs about twice forward.
BACKWARD_SHARE = 2 / 3
# Schedules that cross the network with one rank per node at a time (a ring
# over ranks numbered node by node, a tree whose upper levels have one rank
# per node): they get the node's whole network link. Every other schedule
# shares it among the node's ranks.
ONE_CROSSING_PER_NODE = frozenset({"dense_ring", "topka", "gaussiank", "gtopk"})
# PowerSGD's passes over the gradient per step: the error-feedback add, M·Q,
# Mᵀ·P, the decompression P·Qᵀ and the new residual (torch's
# powerSGD_hook), each reading or writing n values.
POWERSGD_PASSES = 6
# DeMo's passes over the parameters per step besides its Ok-Topk call: the
# momentum update, the blockwise DCT of the momentum and the inverse DCT of
# the result (a 64-point transform each way, read and written), the
# selection's and the sign update's, about 12 reads or writes of n values.
DEMO_PASSES = 12
# The hook's momentum correction (oktopk.momentum), on a sparse path under
# SGD with momentum, per step in reads or writes of n values: the velocity
# g + m·b (2 read, 1 written), handing it over as the gradient (1 and 1),
# and the G handed to the optimizer, S − m·B (2 and 1).
CORRECTION_PASSES = 8
DEMO_DENSITY = TOPK / (CHUNK * CHUNK)  # coefficients kept per 64 x 64 block
QUANTIZED_BYTES_PER_VALUE = (quantized.BITS + 16 / quantized.BLOCK) / 8
# The 4-bit path's work beside the ring's (oktopk.quantized's allreduce_),
# in reads or writes of float32 values, a 4-bit code an eighth, as
# (over the whole bucket, over the owner's 1/P chunk):
# - "library", on the host's cores (``shared_cores``), its one-pass rounding:
#   over the bucket, rounding with the residual (reads 2, writes 1, codes
#   1/8), decoding what each exchange brings (1 1/8 each) and the owners'
#   sum reading it (1): 6.5; over the chunk, the sum written (1), divided
#   (2), the owner residual added (3), rounded in place (2 1/8): 8;
# - "tensors", on a GPU, the tensor operations: over the bucket, adding the residual
#   (3), rounding (scales 2, levels 6, codes 1.75, values 2), the new
#   residual (3), packing (1), decoding each exchange's (5 each) and the
#   copy out (2): 30; over the chunk, the average's division (2), its owner
#   residual (3), rounding (12), the new owner residual (3), packing: 20.
QUANTIZED_PASSES = {"library": (6.5, 8), "tensors": (30, 20)}
# config.value_dtype of each format sparse values may travel in
# (include/oktopk.h): what ``--values`` prices.
VALUE_FORMATS = {"float32": _lib.FLOAT32, "float16": _lib.FLOAT16, "bfloat16": _lib.BFLOAT16, "int8": _lib.INT8,
                 "int4": _lib.INT4}
METHODS = ("dense", "bf16", "quantized", "oktopk", "topka", "topkdsa", "gtopk", "gaussiank", "auto", "powersgd", "demo")
SPARSE_ALGORITHMS = {"oktopk": "oktopk", "topka": "topka", "topkdsa": "topkdsa", "gtopk": "gtopk",
                     "gaussiank": "gaussiank", "auto": "auto"}
ADAM_FAMILY = ("adam", "adamw", "nadam", "radam", "adamax", "lamb")


class Link(namedtuple("Link", "bytes_per_second latency")):
    """One link level: bandwidth (bytes/s) and latency (s) of one message."""

    @property
    def seconds_per_byte(self):
        return 1.0 / self.bytes_per_second if self.bytes_per_second != math.inf else 0.0


class Cluster(namedtuple("Cluster", "ranks ranks_per_node inter intra pass_seconds_per_byte compute_seconds overlap "
                                    "host_seconds_per_byte shared_cores", defaults=(0.0, False))):
    """P ranks, R per node; ``inter``, ``intra``: the two Link levels;
    ``pass_seconds_per_byte``: a pass over memory where selection runs
    (γ); ``compute_seconds``: forward, backward and optimizer of one step;
    ``overlap``: the share of backward communication can hide under (0 to
    1); ``host_seconds_per_byte``: the host's work per byte sent (copies, a
    TCP stack), 0 by default; ``shared_cores``: the calls' passes and host
    work run on the cores that compute (ranks on CPUs, or sharing cores),
    so the step pays them in full and only the link's time hides; False
    (the default, GPUs): they run beside backward as the link's time does."""

    @property
    def nodes(self):
        return -(-self.ranks // self.ranks_per_node)


Step = namedtuple("Step", "method seconds communication bytes ran")
# One collective call: ``link``, the seconds of its rounds and bytes on the
# link (they can hide under backward); ``device``, the seconds of its work on
# the device or cores that compute (passes, the host's per-byte work);
# ``bytes``, what one rank sends; ``ran``, the algorithm run.
Call = namedtuple("Call", "link device bytes ran")


def call_link(cluster, algorithm):
    """(latency, seconds per byte) of the link a call of ``algorithm``
    (a library name) is limited by: see the module's text."""
    if cluster.nodes <= 1:
        return cluster.intra.latency, cluster.intra.seconds_per_byte
    share = 1 if algorithm in ONE_CROSSING_PER_NODE else cluster.ranks_per_node
    return cluster.inter.latency, cluster.inter.seconds_per_byte * share


def predict_call(cluster, algorithm, n, density=DEFAULTS.density, value_bytes=4.0, tau=DEFAULTS.tau,
                 tau_prime=DEFAULTS.tau_prime, values="float32"):
    """One call of ``algorithm`` on n values over the cluster's ranks, from
    the library's model: (seconds, bytes one rank sends, the algorithm
    run). ``value_bytes`` < 4: a dense allreduce whose values travel in
    fewer bytes (the library's terms count float32; the time per byte is
    scaled instead, so rounds and passes stay the ring's). ``values``: the
    format a sparse call's selected values travel in (VALUE_FORMATS), for
    the algorithms that take one (the library prices it)."""
    c = call_parts(cluster, algorithm, n, density=density, value_bytes=value_bytes, tau=tau, tau_prime=tau_prime,
                   values=values)
    return c.link + c.device, c.bytes, c.ran


def library_predict(latency, seconds_per_byte, pass_seconds_per_byte, algorithm, n, nranks, density=None, tau=None,
                    tau_prime=None, values="float32"):
    """``_lib.predict_call`` with the sparse values in ``values`` (a name in
    VALUE_FORMATS): the library's model prices a selected entry as its
    value format and coded index take on the wire. Float32 values, and an
    algorithm that sends float32 only, are ``_lib.predict_call`` itself."""
    if values not in VALUE_FORMATS:
        raise ValueError(f"unknown values {values!r}; one of {', '.join(VALUE_FORMATS)}")
    if values == "float32" or algorithm not in _lib.reduced_value_algorithms():
        return _lib.predict_call(latency, seconds_per_byte, pass_seconds_per_byte, algorithm, n, nranks,
                                 density=density, tau=tau, tau_prime=tau_prime)
    link = _lib.new_link_model()
    link.latency_seconds, link.seconds_per_byte, link.pass_seconds_per_byte = latency, seconds_per_byte, pass_seconds_per_byte
    cfg = _lib.default_config(density=density, tau=tau, tau_prime=tau_prime)
    cfg.value_dtype = VALUE_FORMATS[values]
    ran, seconds, sent = ctypes.c_int(-1), ctypes.c_double(), ctypes.c_double()
    code = _lib.lib().oktopk_predict_call(ctypes.byref(link), _lib.algorithm_code(algorithm), n, nranks,
                                          ctypes.byref(cfg), ctypes.byref(ran), ctypes.byref(seconds),
                                          ctypes.byref(sent))
    if code == _lib.INVALID_ARGUMENT:
        raise ValueError(_lib.last_error())
    _lib.check(code)
    return seconds.value, sent.value, _lib.algorithm_name(ran.value)


def call_parts(cluster, algorithm, n, density=DEFAULTS.density, value_bytes=4.0, tau=DEFAULTS.tau,
               tau_prime=DEFAULTS.tau_prime, values="float32"):
    """:func:`predict_call` as a :class:`Call`: its time split into the
    link's and the device's. The library's terms price the call on the
    link's time per byte plus the host's (auto chooses by their sum); the
    device's share is the passes (the terms on a link of no latency and no
    time per byte) plus the host's time per byte sent."""
    if n <= 0:
        return Call(0.0, 0.0, 0.0, algorithm)
    width = value_bytes / 4.0

    def terms(alg, latency, per_byte):
        return library_predict(latency, per_byte * width, cluster.pass_seconds_per_byte, alg, int(n), cluster.ranks,
                               density=density, tau=tau, tau_prime=tau_prime, values=values)

    latency, per_byte = call_link(cluster, algorithm)
    seconds, sent, ran = terms(algorithm, latency, per_byte + cluster.host_seconds_per_byte)
    if ran != algorithm:  # auto: the link of what it chose
        latency, per_byte = call_link(cluster, ran)
        seconds, sent, _ = terms(ran, latency, per_byte + cluster.host_seconds_per_byte)
    passes, _, _ = terms(ran, 0.0, 0.0)
    device = passes + cluster.host_seconds_per_byte * width * sent
    return Call(max(0.0, seconds - device), device, sent * width, ran)


def buckets(n, bucket_bytes=DDP_BUCKET_BYTES):
    """The sizes of DDP's buckets of n float32 values."""
    per = max(1, bucket_bytes // 4)
    full, rest = divmod(int(n), per)
    return [per] * full + ([rest] if rest else [])


def bucketed(cluster, algorithm, n, **kw):
    """Every bucket's :class:`Call` of ``algorithm``, in the order backward
    hands the buckets over (all but the last are of one size: each size is
    priced once)."""
    sizes = buckets(n)
    priced = {size: call_parts(cluster, algorithm, size, **kw) for size in set(sizes)}
    return [priced[size] for size in sizes]


def powersgd_elements(n, rank, matrix_side):
    """(values in P, values in Q) of PowerSGD at ``rank`` for n parameters
    held in square matrices of side ``matrix_side``: (rows + cols) x r per
    matrix, P's rows x r and Q's cols x r."""
    matrices = n / (matrix_side * matrix_side)
    half = matrices * matrix_side * rank
    return half, half


def calls(cluster, method, n, density=DEFAULTS.density, powersgd_rank=4, matrix_side=1024,
          powersgd_elements_total=None, momentum_correction=False, values="float32", rounding=None):
    """One step's reduction by ``method`` (one of METHODS) of n parameters:
    (the calls of DDP's buckets in the order backward hands them over, then
    any work of the step's besides them; whether the calls can hide under
    backward). ``momentum_correction``: a sparse method's step carries the
    hook's momentum correction (SGD with momentum). ``values``: the format
    the sparse methods' selected values travel in (VALUE_FORMATS).
    ``rounding``: whose passes the 4-bit path pays (QUANTIZED_PASSES); by
    default the library's on the host's cores, the tensors' on a GPU."""
    if method == "dense":
        return bucketed(cluster, "dense_ring", n), True
    if method == "bf16":
        return bucketed(cluster, "dense_ring", n, value_bytes=2.0), True
    if method == "quantized":
        bucket_passes, chunk_passes = QUANTIZED_PASSES[rounding or ("library" if cluster.shared_cores else "tensors")]
        passes = bucket_passes + chunk_passes / cluster.ranks
        return [c._replace(device=c.device + passes * 4 * size * cluster.pass_seconds_per_byte)
                for c, size in zip(bucketed(cluster, "dense_ring", n, value_bytes=QUANTIZED_BYTES_PER_VALUE),
                                   buckets(n))], True
    if method in SPARSE_ALGORITHMS:
        parts = bucketed(cluster, SPARSE_ALGORITHMS[method], n, density=density, values=values)
        if momentum_correction:
            parts.append(Call(0.0, CORRECTION_PASSES * 4 * n * cluster.pass_seconds_per_byte, 0.0, parts[0].ran))
        return parts, True
    if method == "powersgd":
        # Its allreduces of P and of Q, and its passes over the gradient,
        # are spread over the buckets by their sizes (torch's hook runs per
        # bucket).
        if powersgd_elements_total is None:
            p_values, q_values = powersgd_elements(n, powersgd_rank, matrix_side)
        else:
            p_values = q_values = powersgd_elements_total / 2
        parts = bucketed(cluster, "dense_ring", p_values) + bucketed(cluster, "dense_ring", q_values)
        link = sum(c.link for c in parts)
        device = sum(c.device for c in parts) + POWERSGD_PASSES * 4 * n * cluster.pass_seconds_per_byte
        sent = sum(c.bytes for c in parts)
        return [Call(link * s / n, device * s / n, sent * s / n, "dense_ring x 2") for s in buckets(n)], True
    if method == "demo":
        # Ok-Topk on the coefficients, in the optimizer's step: after backward.
        parts = bucketed(cluster, "oktopk", n, density=DEMO_DENSITY)
        transforms = DEMO_PASSES * 4 * n * cluster.pass_seconds_per_byte
        return parts + [Call(0.0, transforms, 0.0, "oktopk")], False
    raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")


def communication(cluster, method, n, **kw):
    """(seconds, bytes per rank, what ran) of one step's reduction by
    ``method`` (one of METHODS) of n parameters: its calls in all, hidden
    or not."""
    cs, _ = calls(cluster, method, n, **kw)
    return (sum(c.link + c.device for c in cs), sum(c.bytes for c in cs),
            "+".join(sorted({c.ran for c in cs})) if cs else "")


def exposed_link(link_seconds, sizes, window):
    """The link time left after backward: bucket i is handed over when
    ``window`` has produced its values (evenly, in order) and its call
    starts once the previous one is done.

    A model's buckets are nearly all of one size, so the calls come in runs
    of equal ones, each taken whole: for c calls of time L handed over
    evenly at a_1 .. a_c, the last ends at max(done + cL, a_i + (c-i+1)L
    over i), and since a_i is linear in i the latter is largest at i = 1 or
    i = c (a trillion parameters are 150,000 buckets)."""
    total, ready, done = sum(sizes), 0.0, 0.0
    for (link, size), run in itertools.groupby(zip(link_seconds, sizes)):
        count = sum(1 for _ in run)
        first = window * (ready + size) / total if total else 0.0
        ready += count * size
        last = window * ready / total if total else 0.0
        done = max(done + count * link, first + count * link, last + link)
    return max(0.0, done - window)


def step(cluster, method, n, **kw):
    """One training step's :class:`Step` by ``method``."""
    cs, hides = calls(cluster, method, n, **kw)
    window = cluster.overlap * BACKWARD_SHARE * cluster.compute_seconds if hides else 0.0
    sizes = buckets(n)
    hidden = cs[:len(sizes)] if hides else []
    rest = cs[len(hidden):]  # after backward: DeMo's exchange, the work beside the calls

    def hiding(c):  # the share of a call that can run beside backward
        return c.link if cluster.shared_cores else c.link + c.device

    paid = sum(c.link + c.device - hiding(c) for c in hidden) + sum(c.link + c.device for c in rest)
    exposed = exposed_link([hiding(c) for c in hidden], sizes, window)
    runs = sorted({c.ran for c in cs})
    return Step(method, cluster.compute_seconds + paid + exposed, sum(c.link + c.device for c in cs),
                sum(c.bytes for c in cs), "+".join(runs))


def hook_default(cluster, n, optimizer, density=DEFAULTS.density, margin=choice.DEFAULT_MARGIN, momentum=0.9):
    """What ``oktopk_hook``'s defaults would run, and why: (path, reason).
    Under SGD the hook times native steps against sparse ones (Ok-Topk at
    ``density``, with its momentum correction when ``momentum`` > 0) and
    keeps sparse only when it saves ``margin`` of the native step
    (``oktopk.choice``); under an Adam-family optimizer sparse is out, and
    it measures its ``dense_compression`` (the 4-bit path by default)
    against float32 the same way."""
    native = step(cluster, "dense", n)
    if optimizer.lower() in ADAM_FAMILY:
        candidate = default_of("dense_compression")
        compressed = step(cluster, candidate, n)
        demo = step(cluster, "demo", n)
        path = candidate if compressed.seconds <= (1 - margin) * native.seconds else "dense"
        why = (f"{optimizer} is Adam-family: sparse gradients are out (oktopk.optimizers); {candidate} "
               f"{compressed.seconds * 1e3:.4g} ms against float32 {native.seconds * 1e3:.4g} ms, margin {margin:.0%}: "
               f"{candidate if path == candidate else 'float32'}. The hook's notice recommends oktopk.optim.DeMo: "
               f"{demo.seconds * 1e3:.4g} ms, {demo.bytes / 1e6:.4g} MB per rank")
        return path, why
    sparse = step(cluster, "oktopk", n, density=density, momentum_correction=momentum > 0)
    path = "sparse" if sparse.seconds <= (1 - margin) * native.seconds else "native"
    why = (f"sparse (Ok-Topk at density {density:g}) {sparse.seconds * 1e3:.4g} ms against native "
           f"{native.seconds * 1e3:.4g} ms: {'saves' if path == 'sparse' else 'does not save'} the {margin:.0%} "
           "margin (oktopk.choice)")
    return path, why


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text):
    """A bandwidth in bytes per second from "25gbit", "100Gbit/s", "600GB/s",
    "200mbit", "1.5e9" (bytes/s) or "inf"; ValueError otherwise. Bits:
    "bit"; bytes: "B" (or "byte")."""
    t = str(text).strip()
    if t.lower() in ("inf", "infinite"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)(bit|bps|b|B|byte|bytes)?(/s)?", t)
    if not m:
        raise ValueError(f"bad bandwidth {text!r}: want e.g. 25gbit, 100Gbit/s, 600GB/s, 200mbit")
    value, prefix, unit = float(m.group(1)), m.group(2).lower(), m.group(3) or "B"
    bits = unit in ("bit", "bps", "b")
    rate = value * _UNITS[prefix] / (8 if bits else 1)
    if not rate > 0:
        raise ValueError(f"bad bandwidth {text!r}: must be > 0")
    return rate


def parse_seconds(text):
    """A duration in seconds from "5us", "2ms", "0.3s", "1e-5"."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s)?", str(text).strip())
    if not m:
        raise ValueError(f"bad duration {text!r}: want e.g. 5us, 2ms, 0.3s")
    seconds = float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
    if not seconds < math.inf:
        raise ValueError(f"bad duration {text!r}: must be finite")
    return seconds


def _arg(parse):
    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def _positive(kind, most=None, what=None):
    """A positive number (kind int: a whole one), at most ``most``."""
    what = what or f"a positive {'integer' if kind is int else 'number'}"

    def convert(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < v < math.inf or (kind is int and v != int(v)):
            raise argparse.ArgumentTypeError(f"{text!r}: want {what}")
        if most is not None and v > most:
            raise argparse.ArgumentTypeError(f"{text!r}: want {what} of at most {most:.4g}")
        return kind(v)
    return convert


def _density(text):
    """A density as the hook takes it: in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a density in (0, 1], as OkTopkState takes it")
    return v


def _fraction(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a number in [0, 1]")
    return v


# The planner's bounds. Parameters: a trillion, DDP's 25 MiB buckets of it
# are 150,000 calls to place (about 5 s here); ranks: the library's int.
MAX_PARAMS = 10**12
MAX_RANKS = 2**31 - 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the arguments)\n")


def parser():
    p = _Parser(
        prog="python -m oktopk.plan",
        description="Predict a data-parallel training step with each method (dense float32, bf16, 4-bit, "
                    "Ok-Topk and its baselines, PowerSGD, DeMo), from the library's own cost model, say what "
                    "oktopk_hook's defaults would choose, and save a map of Ok-Topk's speedup over dense against "
                    "bandwidth and ranks.")
    p.add_argument("--params", type=_positive(int, MAX_PARAMS, "a whole number of parameters >= 1"), required=True,
                   help=f"parameters (gradient values), e.g. 1.3e9 (at most {MAX_PARAMS:.0e})")
    p.add_argument("--ranks", type=_positive(int, MAX_RANKS), required=True, help="data-parallel ranks P")
    p.add_argument("--ranks-per-node", type=_positive(int, MAX_RANKS), default=8, help="ranks per node R (default 8)")
    p.add_argument("--link", type=_arg(parse_rate), required=True,
                   help="bandwidth between nodes, per node: 25gbit, 100Gbit/s, 12.5GB/s")
    p.add_argument("--latency", type=_arg(parse_seconds), default=10e-6,
                   help="latency of one message between nodes (default 10us)")
    p.add_argument("--intra", type=_arg(parse_rate), default=parse_rate("100GB/s"),
                   help="bandwidth per rank inside a node (default 100GB/s; NVLink: 600GB/s)")
    p.add_argument("--intra-latency", type=_arg(parse_seconds), default=5e-6, help="latency inside a node (default 5us)")
    p.add_argument("--select-gbps", type=_positive(float), default=1000.0,
                   help="GB/s of a pass over memory where selection runs (default 1000: an HBM GPU's; a CPU's: 10)")
    p.add_argument("--compute-ms", type=_positive(float), default=None,
                   help="forward, backward and optimizer of one step (default: 6 x params x tokens-per-rank "
                        "flops at --tflops)")
    p.add_argument("--tokens-per-rank", type=_positive(float), default=4096.0,
                   help="tokens (samples) per rank per step, for the default compute (default 4096)")
    p.add_argument("--tflops", type=_positive(float), default=200.0,
                   help="sustained TFLOP/s of one rank, for the default compute (default 200)")
    p.add_argument("--overlap", type=_fraction, default=1.0,
                   help="share of backward the communication can hide under, 0 to 1 (default 1: DDP's buckets)")
    p.add_argument("--optimizer", default="sgd", help="sgd, or an Adam-family name (adam, adamw, ...)")
    p.add_argument("--momentum", type=_fraction, default=0.9,
                   help="SGD's momentum (default 0.9): above 0 the sparse methods' steps carry the hook's "
                        "momentum correction")
    p.add_argument("--density", type=_density, default=DEFAULTS.density,
                   help=f"density of the sparse methods (default {DEFAULTS.density})")
    p.add_argument("--values", choices=tuple(VALUE_FORMATS), default="float32",
                   help="the format the sparse methods' selected values travel in (default float32; DeMo's stay "
                        "float32); indices always travel coded")
    p.add_argument("--powersgd-rank", type=_positive(int), default=4, help="PowerSGD's rank (default 4)")
    p.add_argument("--matrix-side", type=_positive(int), default=1024,
                   help="side of the square matrices PowerSGD assumes the parameters are in (default 1024)")
    p.add_argument("--map", default=None, metavar="PATH",
                   help="also save a map of Ok-Topk's speedup over dense against bandwidth and ranks: PATH as a PNG "
                        "(with matplotlib) and always a CSV beside it (default: no files written)")
    p.add_argument("--no-map", action="store_true", help="save no map (the default; kept for older scripts)")
    return p


def cluster_from(args, ranks=None, rate=None):
    compute = args.compute_ms / 1e3 if args.compute_ms else 6 * args.params * args.tokens_per_rank / (args.tflops * 1e12)
    return Cluster(ranks=ranks or args.ranks, ranks_per_node=args.ranks_per_node,
                   inter=Link(rate or args.link, args.latency), intra=Link(args.intra, args.intra_latency),
                   pass_seconds_per_byte=1 / (args.select_gbps * 1e9), compute_seconds=compute, overlap=args.overlap)


def corrected(args):
    """Whether the sparse methods' steps carry the hook's momentum correction."""
    return args.optimizer.lower() == "sgd" and args.momentum > 0


MAP_RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
MAP_RATES_GBIT = (1, 2.5, 5, 10, 25, 50, 100, 200, 400)


def speedup_map(args):
    """Rows of (ranks, Gbit/s, dense ms, Ok-Topk ms, speedup) over the map's
    grid, for the model size given."""
    rows = []
    for ranks in MAP_RANKS:
        for gbit in MAP_RATES_GBIT:
            c = cluster_from(args, ranks=max(ranks, 1), rate=gbit * 1e9 / 8)
            dense = step(c, "dense", args.params).seconds
            sparse = step(c, "oktopk", args.params, density=args.density,
                          momentum_correction=corrected(args)).seconds
            rows.append((ranks, gbit, dense * 1e3, sparse * 1e3, dense / sparse))
    return rows


def save_map(args, rows):
    """The map as a PNG (matplotlib) and always as CSV beside it; returns
    the paths written."""
    base, ext = os.path.splitext(args.map)
    csv_path = base + ".csv"
    with open(csv_path, "w") as f:
        f.write("ranks,inter_node_gbit,dense_ms,oktopk_ms,speedup\n")
        for r in rows:
            f.write(f"{r[0]},{r[1]:g},{r[2]:.4g},{r[3]:.4g},{r[4]:.3f}\n")
    written = [csv_path]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    grid = [[r[4] for r in rows if r[0] == ranks] for ranks in MAP_RANKS]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    im = ax.imshow(grid, origin="lower", aspect="auto", cmap="RdYlGn", norm=matplotlib.colors.LogNorm(0.25, 4))
    ax.set_xticks(range(len(MAP_RATES_GBIT)), [f"{g:g}" for g in MAP_RATES_GBIT])
    ax.set_yticks(range(len(MAP_RANKS)), [str(r) for r in MAP_RANKS])
    for i, line in enumerate(grid):
        for j, v in enumerate(line):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("inter-node bandwidth per node (Gbit/s)")
    ax.set_ylabel("ranks P")
    ax.set_title(f"Ok-Topk (density {args.density:g}) step speedup over dense, {args.params:.3g} params, "
                 f"{args.ranks_per_node} per node", fontsize=9)
    fig.colorbar(im, ax=ax, label="dense step / Ok-Topk step")
    fig.tight_layout()
    png = base + (ext or ".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [png] + written


def report(args, out=None):
    out = sys.stdout if out is None else out  # read at the call: a caller may have replaced it
    c = cluster_from(args)
    n = args.params
    rate_gbit = args.link * 8 / 1e9
    print(f"{n:.4g} parameters, {args.ranks} ranks ({c.nodes} nodes of {args.ranks_per_node}), "
          f"{rate_gbit:.4g} Gbit/s and {args.latency * 1e6:.3g} us between nodes, "
          f"{args.intra / 1e9:.4g} GB/s inside; compute {c.compute_seconds * 1e3:.4g} ms per step, "
          f"overlap {args.overlap:g}, selection at {args.select_gbps:g} GB/s", file=out)
    print(f"{'method':<10} {'step ms':>10} {'comm ms':>10} {'MB/rank':>10} {'x dense':>8}  runs", file=out)
    kw = dict(density=args.density, powersgd_rank=args.powersgd_rank, matrix_side=args.matrix_side)
    if args.values != "float32":
        print(f"sparse methods' values: {args.values}", file=out)
    dense = step(c, "dense", n)
    for m in METHODS:
        s = step(c, m, n, **kw, momentum_correction=corrected(args), values=args.values if m != "demo" else "float32")
        print(f"{m:<10} {s.seconds * 1e3:>10.4g} {s.communication * 1e3:>10.4g} {s.bytes / 1e6:>10.4g} "
              f"{dense.seconds / s.seconds:>8.3g}  {s.ran}", file=out)
    path, why = hook_default(c, n, args.optimizer, density=args.density, momentum=args.momentum)
    print(f"oktopk_hook's defaults: {path} (after {DEFAULT_WARMUP_ITERS} dense warm-up steps). {why}", file=out)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.ranks_per_node > args.ranks:
        p.error(f"--ranks-per-node {args.ranks_per_node} exceeds --ranks {args.ranks}")
    if args.optimizer.lower() not in ADAM_FAMILY + ("sgd",):
        p.error(f"--optimizer {args.optimizer!r}: want sgd or one of {', '.join(ADAM_FAMILY)}")
    if args.map is not None and args.no_map:
        p.error("--map and --no-map: pass one")
    if args.map is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.map))):
        p.error(f"--map {args.map!r}: no such directory")
    compute = cluster_from(args).compute_seconds
    if not 0 < compute < math.inf:
        p.error(f"the step's compute comes to {compute:g} s: lower --tokens-per-rank or --params, or raise --tflops")
    try:
        report(args)
        if args.map is not None:
            for path in save_map(args, speedup_map(args)):
                print(f"map: {path}")
    except (ValueError, OverflowError, OSError) as e:  # the library's refusal of a point, an unwritable map
        p.exit(1, f"{p.prog}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
