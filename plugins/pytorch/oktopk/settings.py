"""The sparse-allreduce settings shared by the DDP hook's OkTopkState and
Horovod's Compression.oktopk: their defaults and their checks, in one place,
so that both accept and refuse the same values with the same messages (and
the DDP hook's own warm-up length, beside them); and the ranks' agreement
on the settings that decide which collectives a rank issues, which every
front end runs before its first step."""

import dataclasses
import hashlib
import numbers
from collections import namedtuple

from . import _lib
from .adaptive import DEFAULT_EVERY, check_adaptive
from .choice import DEFAULT_MARGIN, DEFAULT_RECHECK_EVERY, DEFAULT_SPARSE_AFTER, QUANTIZED, check_choice, check_dense_compression, \
    check_sparse_after
from .comm import value_dtype_name
from .schedule import check_schedule

MAX_INT32 = 2**31 - 1

Checked = namedtuple(
    "Checked",
    "density algorithm tau tau_prime timeout value_dtype stochastic_rounding density_schedule measure_xi_every adaptive",
)


def is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_settings(density, algorithm, tau, tau_prime, timeout, value_dtype, stochastic_rounding, density_schedule, measure_xi_every,
                   adaptive):
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
    if not isinstance(stochastic_rounding, bool) or stochastic_rounding and value_dtype not in ("float16", "bfloat16"):
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
    return Checked(float(density), algorithm, int(tau), int(tau_prime), float(timeout), value_dtype, stochastic_rounding, density_schedule,
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


# momentum_masking's default: DGC's masking of the entries that waited
# ("waited"), over the first AUTO_MASKING_STEPS steps that make a sparse
# call, wherever it can act (the momentum correction on, float32 values,
# the DDP hook); off elsewhere. Those steps are where an entry first
# arrives as a burst of the velocity steps it waited through. On the
# Fashion CNN over 1,200 steps (3 seeds) masking every sparse step ended
# 0.71 points below dense, masking the first 100 0.42, none 0.25; on
# VGG-16 after its 4-bit early steps the masking kept the run from
# falling back to chance (results/sgd.md).
AUTO_MASKING = "auto"
AUTO_MASKING_STEPS = 100


def check_momentum_options(momentum_correction, momentum_masking, local_clip_norm, value_dtype):
    """The momentum correction's DGC rules (oktopk.momentum), checked:
    (momentum_masking, local_clip_norm as a float or None); ValueError
    naming the bad one. momentum_masking is "auto" (AUTO_MASKING), False,
    True, "waited", or (True or "waited", steps): that rule over the first
    ``steps`` steps with a sparse call. Both act inside the correction, so
    each named one needs it on; masking reads which entries left from the
    residual, where a float32 value leaves exactly 0 (a 16-bit one leaves
    its rounding)."""
    rule = momentum_masking
    if isinstance(momentum_masking, (tuple, list)) and len(momentum_masking) == 2:
        rule, steps = momentum_masking
        if rule not in (True, "waited") or not isinstance(rule, (bool, str)) or not is_int(steps) or steps < 1:
            raise ValueError(f"momentum_masking as (rule, steps) needs the rule True or \"waited\" and steps a positive "
                             f"integer, got {momentum_masking!r}")
        momentum_masking = (rule, int(steps))
    elif momentum_masking == AUTO_MASKING:
        rule = False  # it yields where it cannot act, and asks for nothing
    elif not isinstance(momentum_masking, bool) and momentum_masking != "waited":
        raise ValueError(f"momentum_masking must be \"auto\", False, True, \"waited\" or (True or \"waited\", steps), got "
                         f"{momentum_masking!r}")
    if local_clip_norm is not None and (not is_real(local_clip_norm) or not 0.0 < local_clip_norm < float("inf")):
        raise ValueError(f"local_clip_norm must be None or a positive finite number, got {local_clip_norm!r}")
    if (rule or local_clip_norm is not None) and not momentum_correction:
        name = "momentum_masking" if rule else "local_clip_norm"
        raise ValueError(f"{name} acts inside the momentum correction: it needs momentum_correction=True")
    if rule and value_dtype != "float32":
        raise ValueError(f"momentum_masking needs value_dtype float32 (a sent {value_dtype} value leaves its rounding in the "
                         f"residual, so which entries left cannot be read there), got {value_dtype!r}")
    return momentum_masking, None if local_clip_norm is None else float(local_clip_norm)


def masking_rule(momentum_masking, momentum_correction, value_dtype):
    """(rule, steps) of a checked momentum_masking: the rule the correction
    masks by (False, True or "waited") and over how many steps with a
    sparse call (None: all of them)."""
    if momentum_masking == AUTO_MASKING:
        if momentum_correction and value_dtype == "float32":
            return "waited", AUTO_MASKING_STEPS
        return False, None
    if isinstance(momentum_masking, tuple):
        return momentum_masking
    return momentum_masking, None


# What a lost rank does (Faults.on_rank_loss): fail-stop, or go on over
# the survivors (oktopk.continuing).
ON_RANK_LOSS = ("stop", "continue")


def check_on_rank_loss(value):
    """``value`` if it names a way (``ON_RANK_LOSS``); ValueError otherwise."""
    if value not in ON_RANK_LOSS:
        raise ValueError(f"on_rank_loss must be one of {', '.join(repr(v) for v in ON_RANK_LOSS)}, got {value!r}")
    return value


# -- the settings object --------------------------------------------------------
#
# What a user sets, in one immutable value that the DDP hook, the FSDP2
# registration and Horovod's optimizer share: three settings at the top (the
# ones a user changes: the density, the algorithm, the timeout) and the
# rest in named groups, each with its defaults. Settings() checks every
# value when it is made, here and nowhere else.


@dataclasses.dataclass(frozen=True)
class Warmup:
    """The steps reduced densely first (OkTopkState's ``warmup_iters`` and
    ``warmup_compression``)."""

    iters: int = NATIVE_WARMUP_ITERS
    compression: object = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The measured choice between the process group's allreduce and a
    compressed path (``algorithm=None``; OkTopkState's ``sparse_margin``,
    ``recheck_every``, ``dense_compression``, ``sparse``, ``sparse_after``)."""

    sparse_margin: float = DEFAULT_MARGIN
    recheck_every: int = DEFAULT_RECHECK_EVERY
    dense_compression: object = QUANTIZED
    sparse: bool = True
    sparse_after: int = DEFAULT_SPARSE_AFTER


@dataclasses.dataclass(frozen=True)
class Momentum:
    """The momentum correction under SGD with momentum (OkTopkState's
    ``momentum_correction``, ``momentum_masking``, ``local_clip_norm``)."""

    correction: bool = True
    masking: object = AUTO_MASKING
    local_clip_norm: object = None


@dataclasses.dataclass(frozen=True)
class Wire:
    """How the sparse calls travel and where they run (OkTopkState's
    ``value_dtype``, ``stochastic_rounding``, ``tau``, ``tau_prime``,
    ``device_path``, ``grads_as_bucket_views``)."""

    value_dtype: object = "float32"
    stochastic_rounding: bool = False
    tau: int = 64
    tau_prime: int = 32
    device_path: object = None
    grads_as_bucket_views: bool = True


@dataclasses.dataclass(frozen=True)
class Adaptation:
    """How the density moves during the run (OkTopkState's
    ``density_schedule``, ``adaptive``, ``measure_xi_every``)."""

    density_schedule: object = None
    adaptive: object = None
    measure_xi_every: object = None


@dataclasses.dataclass(frozen=True)
class Faults:
    """What a lost rank does to the run (OkTopkState's ``on_rank_loss``):
    ``"stop"`` (the default) fails the step on every survivor, naming the
    rank, for a restart from a checkpoint (torchrun's ``--max-restarts``);
    ``"continue"`` voids that step and goes on over the survivors
    (``oktopk.continuing``), which needs every step after the warm-up to be
    the library's: a named ``algorithm``, the DDP hook."""

    on_rank_loss: str = "stop"


GROUPS = {"warmup": Warmup, "choice": Choice, "momentum": Momentum, "wire": Wire, "adaptation": Adaptation, "faults": Faults}

# Every setting by the one name OkTopkState's keywords, its attributes,
# checkpoints and error messages know it by: (its group, or None at the
# top, and its field there).
FLAT = {
    "density": (None, "density"),
    "algorithm": (None, "algorithm"),
    "timeout": (None, "timeout"),
    "warmup_iters": ("warmup", "iters"),
    "warmup_compression": ("warmup", "compression"),
    "sparse_margin": ("choice", "sparse_margin"),
    "recheck_every": ("choice", "recheck_every"),
    "dense_compression": ("choice", "dense_compression"),
    "sparse": ("choice", "sparse"),
    "sparse_after": ("choice", "sparse_after"),
    "momentum_correction": ("momentum", "correction"),
    "momentum_masking": ("momentum", "masking"),
    "local_clip_norm": ("momentum", "local_clip_norm"),
    "value_dtype": ("wire", "value_dtype"),
    "stochastic_rounding": ("wire", "stochastic_rounding"),
    "tau": ("wire", "tau"),
    "tau_prime": ("wire", "tau_prime"),
    "device_path": ("wire", "device_path"),
    "grads_as_bucket_views": ("wire", "grads_as_bucket_views"),
    "density_schedule": ("adaptation", "density_schedule"),
    "adaptive": ("adaptation", "adaptive"),
    "measure_xi_every": ("adaptation", "measure_xi_every"),
    "on_rank_loss": ("faults", "on_rank_loss"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a user sets, checked when made (ValueError naming the bad
    setting) and immutable after: ``dataclasses.replace`` or
    :meth:`with_flat` make a changed copy. ``algorithm=None`` is the
    measured choice (``oktopk.choice``)."""

    density: float = 0.01
    algorithm: object = None
    timeout: float = 60.0
    warmup: Warmup = Warmup()
    choice: Choice = Choice()
    momentum: Momentum = Momentum()
    wire: Wire = Wire()
    adaptation: Adaptation = Adaptation()
    faults: Faults = Faults()

    def __post_init__(self):
        for name, kind in GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be an oktopk.{kind.__name__}, got {type(getattr(self, name)).__name__}")
        w, a, m, c = self.wire, self.adaptation, self.momentum, self.choice
        if w.device_path is not None and not isinstance(w.device_path, bool):  # 0 == False, yet 0 is no setting
            raise ValueError(f"device_path must be None, True or False, got {w.device_path!r}")
        # Checked whatever the algorithm, though only the measured choice
        # (algorithm None) reads them: a bad value is refused, never ignored.
        margin, recheck_every = check_choice(c.sparse_margin, c.recheck_every)
        dense_compression = check_dense_compression(c.dense_compression)
        if not isinstance(c.sparse, bool):
            raise ValueError(f"sparse must be True or False, got {c.sparse!r}")
        if not c.sparse and self.algorithm is not None:
            raise ValueError(f"sparse=False is the measured choice without sparse steps: it needs algorithm=None, got "
                             f"algorithm={self.algorithm!r}")
        sparse_after = check_sparse_after(c.sparse_after)
        if not c.sparse and dense_compression is None:
            raise ValueError("sparse=False measures dense_compression's path against native under every optimizer: it needs "
                             "a dense_compression ('quantized', 'bf16' or 'fp16'), got None")
        checked = check_settings(self.density, "auto" if self.algorithm is None else self.algorithm, w.tau, w.tau_prime, self.timeout,
                                 w.value_dtype, w.stochastic_rounding, a.density_schedule, a.measure_xi_every, a.adaptive)
        iters = check_warmup_iters(self.warmup.iters)
        warmup_compression = check_dense_compression(self.warmup.compression, "warmup_compression")
        if not isinstance(w.grads_as_bucket_views, bool):
            raise ValueError(f"grads_as_bucket_views must be True or False, got {w.grads_as_bucket_views!r}")
        if not isinstance(m.correction, bool):
            raise ValueError(f"momentum_correction must be True or False, got {m.correction!r}")
        masking, clip = check_momentum_options(m.correction, m.masking, m.local_clip_norm, checked.value_dtype)
        on_rank_loss = check_on_rank_loss(self.faults.on_rank_loss)
        if on_rank_loss == "continue" and self.algorithm is None:
            raise ValueError("on_rank_loss='continue' needs a named algorithm (algorithm='oktopk', say): the measured choice "
                             "(algorithm=None) gives steps to the process group's own allreduce, which cannot go on without a "
                             "lost rank; a named algorithm's steps after the warm-up are all the library's")
        normalized = {
            "density": checked.density,
            "algorithm": None if self.algorithm is None else checked.algorithm,
            "timeout": checked.timeout,
            "warmup": Warmup(iters, warmup_compression),
            "choice": Choice(margin, recheck_every, dense_compression, c.sparse, sparse_after),
            "momentum": Momentum(m.correction, masking, clip),
            "wire": Wire(checked.value_dtype, checked.stochastic_rounding, checked.tau, checked.tau_prime, w.device_path,
                         w.grads_as_bucket_views),
            "adaptation": Adaptation(checked.density_schedule, checked.adaptive, checked.measure_xi_every),
            "faults": Faults(on_rank_loss),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_flat(cls, **flat):
        """Settings from the flat names of :data:`FLAT` (OkTopkState's
        keywords); TypeError naming an unknown one."""
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"unknown oktopk setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the settings are "
                            f"{', '.join(FLAT)}")
        return cls().with_flat(**flat)

    def with_flat(self, **flat):
        """A copy with the flat-named settings changed (checked again)."""
        top, groups = {}, {}
        for name, value in flat.items():
            group, field = FLAT[name]
            if group is None:
                top[field] = value
            else:
                groups.setdefault(group, {})[field] = value
        for group, fields in groups.items():
            top[group] = dataclasses.replace(getattr(self, group), **fields)
        return dataclasses.replace(self, **top)

    def resumed(self, density_schedule, adaptive, measure_xi_every):
        """A copy with the density's adaptation where a loaded checkpoint's
        run had it (its schedule, its bounds and ξ period: part of the run,
        checked when that run made its settings), not checked again."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "adaptation", Adaptation(density_schedule, adaptive, measure_xi_every))
        return copy

    @staticmethod
    def default(name):
        """The default of the setting named ``name`` (a flat name, see
        :meth:`from_flat`), read without checking anything, so without
        loading the library: for a front end's signature that takes the
        flat names (``oktopk_horovod.Compression.oktopk``)."""
        if name not in FLAT:
            raise KeyError(f"unknown oktopk setting {name!r}; the settings are {', '.join(FLAT)}")
        return default_of(name)

    def flat(self):
        """Every setting by its flat name (:data:`FLAT`), in that order."""
        return {name: getattr(self if group is None else getattr(self, group), field) for name, (group, field) in FLAT.items()}

    def changed(self):
        """The keyword arguments that make these settings from the
        defaults: the top's that differ, and each group that differs with
        only its differing fields (what ``repr`` of a state shows)."""
        default = Settings()
        out = {}
        for f in dataclasses.fields(self):
            value, base = getattr(self, f.name), getattr(default, f.name)
            if value == base:
                continue
            if f.name in GROUPS:
                fields = {g.name: getattr(value, g.name) for g in dataclasses.fields(value) if getattr(value, g.name) != getattr(base, g.name)}
                value = _GroupRepr(type(value).__name__, fields)
            out[f.name] = value
        return out


def default_of(name):
    """The default of the setting named ``name`` (:data:`FLAT`), read from
    the classes above without checking anything (no library loaded)."""
    group, field = FLAT[name]
    holder = Settings if group is None else Settings.__dataclass_fields__[group].default
    return getattr(holder, field) if group is not None else holder.__dataclass_fields__[field].default


# The sparse settings' defaults (algorithm None: the measured choice
# between the framework's allreduce and sparse "auto", see oktopk.choice;
# measure_xi_every None: never, or DEFAULT_EVERY with adaptive), as
# check_settings returns them: read from Settings, the one copy.
DEFAULTS = Checked(*(default_of(name) for name in Checked._fields))


class _GroupRepr:
    """A group in a repr: its name and only its non-default fields."""

    def __init__(self, name, fields):
        self.text = f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def __repr__(self):
        return self.text


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
