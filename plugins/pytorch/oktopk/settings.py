"""The sparse-allreduce settings shared by the DDP hook's OkTopkState and
Horovod's Compression.oktopk: their defaults and their checks, in one place,
so that both accept and refuse the same values with the same messages (and
the DDP hook's own warm-up length, beside them); and the ranks' agreement
on the settings that decide which collectives a rank issues, which every
front end runs before its first step."""

import hashlib
import numbers
from collections import namedtuple

from . import _lib
from .adaptive import DEFAULT_EVERY, check_adaptive
from .comm import value_dtype_name
from .schedule import check_schedule

MAX_INT32 = 2**31 - 1

Settings = namedtuple(
    "Settings",
    "density algorithm tau tau_prime timeout value_dtype stochastic_rounding density_schedule measure_xi_every adaptive",
)


# Every setting's default, the one copy: the DDP state's and the Horovod
# compressor's signatures take theirs from here (algorithm None: the
# measured choice between the framework's allreduce and sparse "auto", see
# oktopk.choice, whose settings are there; measure_xi_every None: never, or
# DEFAULT_EVERY with adaptive).
DEFAULTS = Settings(density=0.01, algorithm=None, tau=64, tau_prime=32, timeout=60.0, value_dtype="float32", stochastic_rounding=False,
                    density_schedule=None, measure_xi_every=None, adaptive=None)


def is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_settings(density=DEFAULTS.density, algorithm=DEFAULTS.algorithm, tau=DEFAULTS.tau, tau_prime=DEFAULTS.tau_prime,
                   timeout=DEFAULTS.timeout, value_dtype=DEFAULTS.value_dtype, stochastic_rounding=DEFAULTS.stochastic_rounding,
                   density_schedule=DEFAULTS.density_schedule, measure_xi_every=DEFAULTS.measure_xi_every, adaptive=DEFAULTS.adaptive):
    """The settings, checked and normalized (algorithm None: the library's
    default; measure_xi_every None with adaptive: its default); ValueError
    naming the first bad one."""
    if not is_real(density) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be a real number in (0, 1], got {density!r}")
    if algorithm is None:
        algorithm = _lib.default_algorithm()
    _lib.algorithm_code(algorithm)  # ValueError naming the choices
    for name, value in (("tau", tau), ("tau_prime", tau_prime)):
        if not is_int(value) or not 1 <= value <= MAX_INT32:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not is_real(timeout) or not 0.0 < timeout <= MAX_INT32 / 1000:
        raise ValueError(f"timeout must be a positive number of seconds (at most {MAX_INT32 // 1000}), got {timeout!r}")
    value_dtype = value_dtype_name(value_dtype)
    if value_dtype != "float32" and algorithm not in (takers := _lib.reduced_value_algorithms()):
        raise ValueError(
            f"value_dtype {value_dtype} needs algorithm {', '.join(takers[:-1])} or {takers[-1]}; {algorithm!r} keeps no residual or "
            f"sends partial sums, whose rounding errors no rank's residual could take back"
        )
    if not isinstance(stochastic_rounding, bool) or stochastic_rounding and value_dtype == "float32":
        raise ValueError(f"stochastic_rounding must be a bool, and True only with float16 or bfloat16 values, got {stochastic_rounding!r}")
    density_schedule = check_schedule(density_schedule, float(density))
    if measure_xi_every is not None and (not is_int(measure_xi_every) or measure_xi_every < 1):
        raise ValueError(f"measure_xi_every must be None or a positive integer, got {measure_xi_every!r}")
    adaptive = check_adaptive(adaptive, int(tau_prime))
    if adaptive is not None and not adaptive[0] <= density <= adaptive[1]:
        raise ValueError(f"density {density!r} is outside adaptive's bounds [{adaptive[0]:g}, {adaptive[1]:g}]: training starts "
                         f"at density and adapts within the bounds, so it must lie within them")
    if adaptive is not None and density_schedule is not None:
        raise ValueError("adaptive and density_schedule both set the density of each step: pass one of them")
    if adaptive is not None and measure_xi_every is None:
        measure_xi_every = DEFAULT_EVERY
    return Settings(float(density), algorithm, int(tau), int(tau_prime), float(timeout), value_dtype, stochastic_rounding, density_schedule,
                    measure_xi_every, adaptive)


def check_process_group(process_group):
    """``process_group`` itself if it is None (the default group) or a
    torch.distributed ProcessGroup; ValueError naming it otherwise, at
    construction rather than as an AttributeError at the first step."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be None (the default group) or a torch.distributed ProcessGroup "
                         f"(dist.new_group(...), mesh.get_group(...)), got {type(process_group).__name__} {process_group!r}")
    return process_group


# DDP reduces its first iteration in a provisional bucket layout and
# rebuilds its buckets after it; the hook learns the rebuilt layout in the
# second. Those two always take the process group's own allreduce.
NATIVE_WARMUP_ITERS = 2
DEFAULT_WARMUP_ITERS = NATIVE_WARMUP_ITERS


def check_warmup_iters(warmup_iters):
    """The DDP hook's dense warm-up length, checked; ValueError saying why
    it must be at least NATIVE_WARMUP_ITERS."""
    if not is_int(warmup_iters) or warmup_iters < NATIVE_WARMUP_ITERS:
        raise ValueError(
            f"warmup_iters must be an integer >= {NATIVE_WARMUP_ITERS} (DDP rebuilds its buckets after the first iteration, and the "
            f"hook learns the rebuilt layout in the second), got {warmup_iters!r}"
        )
    return int(warmup_iters)


def check_momentum_options(momentum_correction, momentum_masking, local_clip_norm, value_dtype):
    """The momentum correction's opt-in DGC rules (oktopk.momentum),
    checked: (momentum_masking, local_clip_norm as a float or None);
    ValueError naming the bad one. Both act inside the correction, so each
    needs it on; masking reads which entries left from the residual, where
    a float32 value leaves exactly 0 (a 16-bit one leaves its rounding)."""
    if not isinstance(momentum_masking, bool) and momentum_masking != "waited":
        raise ValueError(f"momentum_masking must be False, True or \"waited\", got {momentum_masking!r}")
    if local_clip_norm is not None and (not is_real(local_clip_norm) or not 0.0 < local_clip_norm < float("inf")):
        raise ValueError(f"local_clip_norm must be None or a positive finite number, got {local_clip_norm!r}")
    if (momentum_masking or local_clip_norm is not None) and not momentum_correction:
        name = "momentum_masking" if momentum_masking else "local_clip_norm"
        raise ValueError(f"{name} acts inside the momentum correction: it needs momentum_correction=True")
    if momentum_masking and value_dtype != "float32":
        raise ValueError(f"momentum_masking needs value_dtype float32 (a sent {value_dtype} value leaves its rounding in the "
                         f"residual, so which entries left cannot be read there), got {value_dtype!r}")
    return momentum_masking, None if local_clip_norm is None else float(local_clip_norm)


# -- agreement across ranks ---------------------------------------------------
#
# Ranks whose settings differ issue different collectives (one a dense
# warm-up allreduce, the other a sparse call; one a quantized all-to-all,
# the other a bfloat16 allreduce): they block each other until the process
# group's timeout (gloo's default: 30 minutes) or abort inside it, and
# nothing names the setting. So each front end first exchanges a digest of
# those settings in one collective that every rank issues alike whatever
# its settings; only when the digests differ does a second one, issued
# alike by every rank too (each saw the same digests), gather the settings
# themselves so that the error names each differing one and every rank's
# value.

DIGEST_BYTES = 16


def settings_digest(settings):
    """DIGEST_BYTES bytes standing for ``settings`` (a dict of plain values:
    numbers, strings, None, tuples of them), the same on every rank for
    equal settings."""
    text = repr(sorted((name, repr(value)) for name, value in settings.items()))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def settings_differences(every):
    """What differs between the ranks' settings (``every``: one dict per
    rank, in rank order), one clause per setting: "name: rank 0 has a,
    rank 1 has b"."""
    names = sorted({name for settings in every for name in settings})
    clauses = []
    for name in names:
        values = [settings.get(name) for settings in every]
        if any(repr(v) != repr(values[0]) for v in values[1:]):
            clauses.append(f"{name}: " + ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values)))
    return "; ".join(clauses)


def check_agreement(settings, gather_digests, gather_settings, who="oktopk"):
    """Raise OkTopkError (MISMATCH) on every rank, naming each setting that
    differs and every rank's value, unless every rank holds ``settings``.
    ``gather_digests(bytes)``: every rank's DIGEST_BYTES bytes, in rank
    order, through one fixed-size collective; ``gather_settings(dict)``:
    every rank's dict, in rank order (called only on a mismatch, then by
    every rank)."""
    digests = gather_digests(settings_digest(settings))
    if all(d == digests[0] for d in digests[1:]):
        return
    every = gather_settings(settings)
    differences = settings_differences(every) or "(the digests differ, the values print alike)"
    raise _lib.OkTopkError(_lib.MISMATCH, f"{who}: settings differ across ranks: {differences}")


def process_group_agreement(process_group, device, timeout=None, what="the settings' agreement", who="oktopk"):
    """(gather_digests, gather_settings) for :func:`check_agreement` over a
    torch.distributed process group; the digests travel as a tensor on
    ``device`` (NCCL wants the bucket's device). With ``timeout`` (seconds),
    the digests' gather waits at most that long and then raises OkTopkError
    (TIMEOUT) naming ``what``: a rank that stopped or died before it would
    otherwise hold the others for the process group's own timeout (gloo's
    default: 30 minutes). The settings' gather follows only once every
    rank's digest has come, so every rank is there for it."""
    import datetime

    import torch
    import torch.distributed as dist

    def gather_digests(digest):
        mine = torch.tensor(list(digest), dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
        if timeout is None:
            dist.all_gather(every, mine, group=process_group)
        else:
            work = dist.all_gather(every, mine, group=process_group, async_op=True)
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
            except RuntimeError as e:
                raise _lib.OkTopkError(_lib.TIMEOUT, f"{who}: not every rank reached {what} within {timeout:g} s: a rank "
                                                     f"stopped, died, or is still in an earlier step ({e})") from e
        return [bytes(t.tolist()) for t in every]

    def gather_settings(settings):
        every = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(every, settings, group=process_group)
        return every

    return gather_digests, gather_settings


# -- checkpoint checksums -------------------------------------------------------
#
# The library's tensor states carry a CRC-32C of their bytes; a front end's
# own checkpoint (which rank it belongs to, the layout, the choice, the
# quantized residuals) carries this checksum of its content, so that a
# corrupted or hand-edited one is refused at load rather than continued
# from (a "rank" field changed would otherwise pass the ownership check).

CHECKSUM_KEY = "checksum"


def _feed(h, x):
    """x into the hash h, canonically: dict keys sorted, a list and a
    tuple alike (a checkpoint's container may turn one into the other), a
    tensor by dtype, shape and bytes."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        h.update(b"{")
        for key in sorted(x, key=repr):
            _feed(h, key)
            _feed(h, x[key])
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[")
        for item in x:
            _feed(h, item)
        h.update(b"]")
    elif type(x).__module__ == "numpy" and hasattr(x, "tobytes"):  # an array's repr elides its middle
        h.update(f"N{x.dtype}{getattr(x, 'shape', ())}:".encode())
        h.update(x.tobytes())
    elif isinstance(x, (bytes, bytearray, memoryview)):
        h.update(b"B%d:" % len(x))
        h.update(bytes(x))
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


def content_checksum(state):
    """The checksum (hex) of a checkpoint dict's content, its own
    CHECKSUM_KEY left out."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, {key: value for key, value in state.items() if key != CHECKSUM_KEY})
    return h.hexdigest()


def with_checksum(state):
    """``state`` (a checkpoint dict) with the checksum of its content."""
    return {**state, CHECKSUM_KEY: content_checksum(state)}


def check_checksum(state, what):
    """ValueError unless ``state`` holds the checksum of its content. A
    state without one is refused too: dropping the key must not be a way
    around the check."""
    if CHECKSUM_KEY not in state or state[CHECKSUM_KEY] != content_checksum(state):
        raise ValueError(
            f"oktopk: this {what} checkpoint fails its checksum: a field or byte changed after it was saved (a hand edit, "
            f"a corrupted or truncated file). Load the checkpoint this rank saved, intact, or do not load the oktopk state "
            f"(load only the model and optimizer) and it starts afresh."
        )
