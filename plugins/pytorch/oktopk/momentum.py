"""Momentum correction (Lin et al., Deep Gradient Compression, ICLR 2018)
for parameters that ``torch.optim.SGD`` steps with momentum.

Why. With error feedback alone, the optimizer applies its momentum to the
sparse average: an entry that waited ~1/density steps in the residual
arrives as the sum of those steps' gradients, and momentum keeps moving
the weight by that burst for ~1/(1 − m) more steps, ten at m = 0.9. The
demo's MLP then swings by ten points of accuracy and ends five below
dense (results/sgd.md). The correction moves momentum before the
selection: each rank keeps its own velocity b ← m·b + (1 − d)·g (torch's
``momentum_buffer`` arithmetic, on the local gradient), and what the
library reduces and keeps in its residual is the velocity's step (b, or
g + m·b for Nesterov), not the gradient. The reduced average S is then the
update itself: SGD with momentum at density 1, a velocity that waited in
the residual at lower density, but never a burst that momentum multiplies.

How the optimizer steps without a second momentum. The user's optimizer is
left as it is; what the hook hands it as the gradient is the G for which
torch's own momentum arithmetic lands on S:

- SGD: buf ← m·buf + (1 − d)·G, step −lr·buf. With B the optimizer's buffer
  apart from weight decay, G = (S − m·B)/(1 − d) gives buf = S (and B = S).
- Nesterov (d = 0): step −lr·(G + m·buf). G = (S − m²·B)/(1 + m), then
  B ← m·B + G.
- At the optimizer's first step (no buffer yet) torch sets buf = G: G = S
  (Nesterov: S/(1 + m)).

Weight decay is added by the optimizer to G and rides its momentum exactly
as in dense SGD (it is linear and needs no exchange), so ``momentum_buffer``
stays the optimizer's true velocity and a checkpoint of the optimizer
means what it always did. The correction starts when the hook has seen
the optimizer step (after its first step): each parameter's velocity and B
start from the optimizer's ``momentum_buffer``, which is the average of the
ranks' velocities at density 1, so the switch loses nothing. B advances
only when the optimizer steps: a step that ``GradScaler`` skips (a NaN or
Inf) leaves the velocity and B as they were.

A clip after backward (``clip_grad_norm_``, the frameworks' default:
Trainer's ``max_grad_norm``, Lightning's ``gradient_clip_val``) scales
the G the hook handed over by one factor c ≤ 1 before the optimizer
steps, so the optimizer's momentum takes c·G. The correction reads c at
the step from a few values it handed over, and each rank's velocity takes
this step's gradient times c as well (``_follow_scale``): the velocities
stay the optimizer's momentum, and at density 1 the run is dense SGD with
the clip. GradScaler's ``unscale_`` (the velocities and residuals hold
the scaled gradients) and any change that is not one factor on every value
stop the correction instead.

Each rank holds three more copies of the parameters' gradients: its
velocity, the buffer the next one is computed into (a step skipped for a
NaN must find the old one whole), and B. Without weight decay B is the
optimizer's own ``momentum_buffer`` (the same recursion), read in place:
two copies then. Parameters with momentum 0,
``maximize=True``, or another optimizer are reduced as before.

DGC's two other rules (results/sgd.md measures them on the 17.1M MLP, on
a CNN on Fashion-MNIST and on VGG-16):

- Momentum factor masking (``momentum_masking``): zero this rank's velocity
  where its entry was sent, so its momentum does not keep pushing what was
  already delivered (``oktopk.masking``: DGC's rule, "waited", and the
  default's window of the first 100 sparse steps).
- Local gradient clipping: each rank's gradient of each corrected
  parameter is scaled to a norm of at most ``local_clip_norm / sqrt(P)``
  before it enters the velocity (the threshold scaled by 1/sqrt(P), as if
  every rank's gradient were distributed alike). Per parameter, as DGC's
  reference code clips each tensor: the whole model's norm is known only
  after the last bucket, too late for the first one.
"""

import math
import sys

import warnings
import weakref

import torch

from .masking import Masking, zero_where

# A table's missing entry, in a step's record (MomentumCorrection.record_step).
_ABSENT = object()

# The optimizer that owns momentum the correction understands: torch's SGD
# (its subclasses included; their arithmetic is the parent's unless they
# override step, which the correction cannot see).
MOMENTUM_OPTIMIZER = torch.optim.SGD


def _local(t):
    """A DTensor's local shard (FSDP2's parameters, gradients and momentum
    buffers: each rank corrects its own shard), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def momentum_of(group):
    """(m, dampening, nesterov) of a parameter group the correction applies
    to, else None."""
    m = group.get("momentum", 0.0)
    if not m or group.get("maximize", False):
        return None
    return float(m), float(group.get("dampening", 0.0)), bool(group.get("nesterov", False))


def _grad_scaler_is_stepping():
    """Whether a ``torch.amp.GradScaler`` is in this call's stack (its
    ``step`` calls the optimizer's): asked only when the handed gradient
    changed, to tell its unscale_ from a clip."""
    from torch.amp import GradScaler

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), GradScaler):
            return True
        frame = frame.f_back
    return False


class MomentumCorrection:
    """Per-parameter velocity and optimizer-side momentum for one hook
    state, keyed by the layout's canonical parameter index
    (``index_of(param)``, None for a parameter the hook has not numbered).

    Every pass over a gradient is in place, into buffers kept from step to
    step: a fresh gradient-sized tensor costs its page faults on every step
    (on the demo's 17.1M MLP the first version, which allocated, made a
    sparse step 1.8x slower)."""

    # The values of the first corrected slot the sample is taken among.
    SAMPLE_SPAN = 4096

    def __init__(self, index_of, masking=False, clip_norm=None, world_size=None, masking_steps=None):
        self.index_of = index_of
        # DGC's momentum factor masking (oktopk.masking); its changes are
        # recorded with the step's, for a void step to give back.
        self.mask = Masking(masking, masking_steps, note=self._note)
        self.clip_norm = clip_norm  # DGC's local gradient clipping: the max norm before the 1/sqrt(P) scaling, or None
        # The ranks that average now (a callable): P changes when the
        # survivors of a lost rank go on without it (oktopk.continuing).
        self.world_size = world_size
        self._clip_at = None  # (P, clip_norm / sqrt(P)), once P is known
        self._optimizer = None  # weakref to the SGD optimizer seen stepping the hook's parameters
        self._group_of = {}  # id(param) -> its parameter group (refreshed when a param is missing)
        self.settings = {}  # index -> (m, dampening, nesterov) at the optimizer's latest step
        self.velocity = {}  # index -> this rank's velocity b (flat, the bucket's dtype and device)
        self.applied = {}  # index -> B, the optimizer's momentum apart from weight decay (None: no step yet)
        self._borrowed = set()  # indices whose B is a view of the optimizer's momentum_buffer (_borrow)
        self._spare = {}  # index -> the buffer this step's velocity is computed into (swapped in when it counts)
        self._handed = {}  # index -> (m, dampening) of the G handed over this step, for B at the optimizer's step
        # A few values the hook handed the optimizer this step ((index,
        # offset, value): the largest and smallest nonzero among the first
        # SAMPLE_SPAN of two corrected slots, ``after``), read again when it
        # steps: what changed them in between (_scale_at_step).
        self._samples = []
        self.stopped = None  # why the correction stopped, or None
        # This step's changes to the velocities, B and the masking's marks,
        # (what, index, the value before, or _ABSENT), for a step that turns
        # out void to give back (record_step); None: not recording.
        self._record = None
        self._folds = None  # the hook's StepFolds, told when a bucket comes back non-finite
        # This step hands the gradient through (begin_step's idle): a native
        # step with no residual held.
        self.idle = False
        # index -> the optimizer's momentum_buffer (a flat view) that the
        # velocity and B were set to by an idle step: never written here,
        # and never kept as a spare for a new velocity to be computed into.
        self._following = {}
        # index -> (the momentum_buffer followed, the B then set, whether
        # its group had weight decay): what the views in _following were
        # taken of (_follow).
        self._followed = {}

    @property
    def masking(self):
        """The masking rule (False, True or "waited"), over its window."""
        return self.mask.rule

    # -- the optimizer -----------------------------------------------------

    def stepped(self, optimizer):
        """After each step of an SGD optimizer that steps the hook's
        parameters: B follows the G the optimizer took (B ← m·B + (1 − d)·G,
        torch's own recursion apart from weight decay), and each parameter
        it now holds a momentum buffer for starts its velocity and B from
        it (the average of the ranks' velocities so far: nothing is lost
        when the correction starts)."""
        if self.stopped is not None:
            return
        if self._optimizer is None or self._optimizer() is not optimizer:
            self._optimizer = weakref.ref(optimizer)
            self._group_of = {}
        samples, self._samples = self._samples, []
        handed, self._handed = self._handed, {}
        scale = self._scale_at_step(optimizer, samples) if samples else 1.0
        if scale is None:
            return
        for group in optimizer.param_groups:
            settings = momentum_of(group)
            if settings is None:
                continue
            for p in group["params"]:
                i = self.index_of(p)
                if i is None:
                    continue
                self.settings[i] = settings
                if self.idle:
                    self._follow(optimizer, group, p, i)
                    continue
                grad = None if p.grad is None else _local(p.grad).reshape(-1)
                if i in handed and grad is not None:
                    if scale != 1.0:
                        self._follow_scale(i, scale, handed[i][0])
                    if self._borrow(optimizer, group, p, i):
                        continue
                    m, d = handed[i]
                    g = grad
                    before = self.applied.get(i)
                    if i in self._borrowed:  # the optimizer's buffer until now: never written here
                        self._borrowed.discard(i)
                        before = self.applied[i] = None if before is None else before.clone()
                    if before is None:
                        self.applied[i] = g.clone()  # torch's first step: buf = G
                    elif d:
                        before.mul_(m).add_(g, alpha=1.0 - d)
                    else:
                        torch.add(g, before, alpha=m, out=before)
                elif i not in self.velocity:
                    buf = optimizer.state.get(p, {}).get("momentum_buffer")
                    if buf is not None:
                        self.velocity[i] = _local(buf).detach().reshape(-1).clone()
                        if not self._borrow(optimizer, group, p, i):
                            self.applied[i] = self.velocity[i].clone()

    def _follow(self, optimizer, group, p, i):
        """After the optimizer stepped on an idle step (the plain average,
        its own momentum): its momentum_buffer is the average of what the
        ranks' velocities would be, as at the correction's start, so the
        velocity and B follow it (views, no copy: an idle step costs no
        pass). The next corrected step computes a velocity of this rank's
        own from it into a buffer of the correction's; with weight decay it
        copies B then too (``before``), ahead of the optimizer's step that
        moves the buffer."""
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is None:
            return
        view = self._following.get(i)
        decay = bool(group.get("weight_decay", 0.0))
        followed = self._followed.get(i)
        if (followed is not None and followed[0] is buf and followed[2] == decay and self.velocity.get(i) is view
                and self.applied.get(i) is followed[1] and (i in self._borrowed) == (followed[1] is not view)):
            # Already following this buffer since an idle step before, and
            # nothing moved the velocity or B since: the views still hold
            # (the optimizer steps the buffer in place). The hook's cost on
            # a native step is this check, not new views.
            return
        view = self.velocity[i] = self._following[i] = _local(buf).detach().reshape(-1)
        if not self._borrow(optimizer, group, p, i):
            self.applied[i] = view
        self._followed[i] = (buf, self.applied[i], decay)

    def _scale_at_step(self, optimizer, samples):
        """What was done to the handed gradient between the hook and the
        optimizer's step, read from ``samples``: 1.0 for nothing; c for a
        clip that scaled every gradient by the same c ≤ 1, the way
        ``clip_grad_norm_`` (Trainer's ``max_grad_norm``, Lightning's
        ``gradient_clip_val``, Accelerate's ``clip_grad_norm_``) does, which
        the correction follows (_follow_scale); None once it stopped for
        anything else. Every rank reads the same c: the clip's norm is over
        the reduced gradient."""
        grads = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self.index_of(p)
                if i is not None and p.grad is not None:
                    grads[i] = p.grad
        ratios, eps = [], 0.0
        for i, j, handed in samples:
            if i in grads:
                ratios.append((i, handed, _local(grads[i]).reshape(-1)[j].item()))
                eps = max(eps, torch.finfo(grads[i].dtype).eps)
        if all(now == handed for _, handed, now in ratios):
            return 1.0
        # One factor, each value rounded once to the gradient's dtype. The
        # factor itself is read from the lowest-numbered parameter's largest
        # value (the first sample of it): the same value on every rank
        # under DDP and in a resumed run.
        scales = [now / handed for _, handed, now in ratios]
        c = scales[min(range(len(ratios)), key=lambda k: (ratios[k][0], k))]
        ratios = [r[1:] for r in ratios]
        changed = f"the gradient it handed the optimizer was changed before the step ({ratios[0][0]!r} became {ratios[0][1]!r}"
        if _grad_scaler_is_stepping():
            # The scaler's unscale_ divides what the hook handed over by the
            # loss scale, while the velocities and the residuals hold the
            # scaled gradients the hook was given: two units in one sum.
            self._stop(f"{changed}: GradScaler's unscale_)")
        elif not (0.0 < c < 1.0 and all(abs(x - c) <= 4 * eps * c for x in scales)):
            self._stop(f"{changed}, not by one factor ≤ 1 on every value as clip_grad_norm_ scales them: "
                       "a clip by value, or a change per tensor)")
        else:
            return c
        return None

    def _follow_scale(self, i, c, m):
        """The optimizer's step took c·G (a clip, _scale_at_step): its
        momentum became m·B + c·(1 − d)·(what the average asked), dense SGD's
        with the clipped gradient. This rank's velocity follows with this
        step's gradient scaled by the same c: b ← m·b_old + c·(1 − d)·g,
        which is c·b + (1 − c)·m·b_old with b = m·b_old + (1 − d)·g (Nesterov
        too), b_old the spare ``after`` swapped out. At density 1 that is
        dense SGD with the clip, up to rounding. The residual is left as it
        is: what it holds is still owed, and is scaled by the clip of the
        step that delivers it."""
        velocity = self.velocity[i]
        velocity.mul_(c)
        old = self._spare.get(i)
        if old is not None and self.applied.get(i) is not None:  # applied None: torch's first step, buf = G
            velocity.add_(old, alpha=(1.0 - c) * m)
        masked = self.mask.masked.get(i)
        if masked is not None:  # what masking zeroed stays zero: the clip scales a zero velocity to zero
            zero_where(velocity, masked)

    def _borrow(self, optimizer, group, p, i):
        """Without weight decay B is the optimizer's own momentum_buffer (the
        same recursion, in torch's own rounding): keep a view of it, which
        the optimizer advances in place, rather than a copy advanced by a
        pass of ours (a pass and a gradient-sized copy less per step).
        Re-taken after every step, so a buffer the optimizer replaced (a
        load of its state) is followed. Returns whether B is borrowed."""
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if group.get("weight_decay", 0.0) or buf is None:
            return False
        self.applied[i] = _local(buf).detach().reshape(-1)
        self._borrowed.add(i)
        return True

    def _settings_of(self, p, i):
        """(m, dampening, nesterov) for parameter p (index i), read live from
        the optimizer (a momentum scheduler may change them between
        steps), or as a checkpoint saved them until the optimizer steps."""
        optimizer = None if self._optimizer is None else self._optimizer()
        if optimizer is None:
            return self.settings.get(i)
        group = self._group_of.get(id(p))
        if group is None:
            self._group_of = {id(q): g for g in optimizer.param_groups for q in g["params"]}
            group = self._group_of.get(id(p))
        return None if group is None else momentum_of(group)

    @property
    def active(self):
        return self.stopped is None and bool(self.settings)

    def _stop(self, why):
        """Hand the optimizer its momentum back for the rest of the run: the
        residual's velocity steps are still owed and are sent as they are;
        the optimizer's momentum_buffer is already its true velocity."""
        self.stopped = why
        self.settings, self.velocity, self.applied, self._spare, self._handed = {}, {}, {}, {}, {}
        self._borrowed, self._following, self._followed = set(), {}, {}
        warnings.warn(f"oktopk: momentum correction stopped: {why}. It needs the optimizer to receive the hook's gradient "
                      "unchanged, or scaled alike everywhere by a clip (clip_grad_norm_); the optimizer's own momentum acts "
                      "on the sparse average from now on. Pass momentum_correction=False to say so from the start "
                      "(docs/pytorch.md).", stacklevel=4)

    # -- a step that turns out void ---------------------------------------

    def record_step(self, folds):
        """At each step's first bucket (``folds``: the hook's StepFolds,
        settled): record what this step changes, for ``folds`` to give back
        if the step turns out void. A bucket that comes back non-finite
        (its average is NaN: the script skips the optimizer step) makes it
        void, whatever the step's path (the warm-up's dense steps too). The
        record holds references, never copies: a new velocity is computed
        into the spare buffer and swapped in, so the old one stays whole."""
        record = self._record = []
        self._folds = folds
        folds.took(lambda: self._give_back(record))

    def _note(self, what, i, table):
        if self._record is not None:
            self._record.append((what, i, table.get(i, _ABSENT)))

    def _give_back(self, record):
        """The velocities, B and masking marks as they were before the step
        ``record`` recorded (the newer velocity buffers become spares);
        nothing after a load, which replaced them."""
        if record is not self._record:
            return
        self._record = None
        for what, i, before in reversed(record):
            if what == "velocity":
                newer = self.velocity.pop(i, None)
                if before is not _ABSENT:
                    self.velocity[i] = before
                if newer is not None:
                    self._spare[i] = newer
                continue
            table = {"applied": self.applied, "zero": self.mask.zero, "loaded": self.mask.loaded}[what]
            if before is _ABSENT:
                table.pop(i, None)
            else:
                table[i] = before

    # -- one bucket ----------------------------------------------------------

    def begin_step(self, idle=False):
        """At the step's first bucket: a G handed over for a step whose
        optimizer step never came (the script skipped it) does not count.

        ``idle``: every bucket of the step goes a dense way (native, or
        the 4-bit path, every value every step) with no sparse residual
        held (oktopk.engine). Nothing waits to arrive as a burst, the
        correction's arithmetic would land the optimizer's momentum where
        its own lands (native: exactly; 4 bits: on the rounded average,
        whose error the path keeps), and the step hands the gradient
        through: no pass, no velocity, no masking. The optimizer's momentum_buffer, stepped on it, is where the
        velocities restart at the next corrected step (``_follow``)."""
        self._handed = {}
        self._samples = []
        self.mask.begin_step()
        # DGC's masking (True) zeroes every velocity on a dense step: a rule
        # that acts on a native step too, which then stays corrected. Local
        # clipping bounds what enters a residual: with none held, an idle
        # step clips nothing, as plain DDP does not.
        self.idle = idle and self.mask.now is not True

    def before(self, params, members, tensor):
        """Replace each corrected parameter's gradient in ``tensor`` (the
        bucket) by its velocity's step. Returns what ``after`` needs, or
        None when no parameter of the bucket is corrected."""
        work = []
        if self.clip_norm is not None:
            size = self.world_size()
            if self._clip_at is None or self._clip_at[0] != size:
                self._clip_at = (size, self.clip_norm / math.sqrt(size))
        for p, (i, a, b) in zip(params, members):
            settings = self._settings_of(p, i)
            if settings is None:
                continue
            m, d, nesterov = settings
            g = tensor[a:b]
            if self._clip_at is not None:
                # DGC's local clipping (clip_grad_norm_'s rule, on this
                # rank's gradient of this parameter).
                norm = float(torch.linalg.vector_norm(g, dtype=torch.float32))
                if norm > self._clip_at[1]:
                    g.mul_(self._clip_at[1] / (norm + 1e-6))
            new = self._spare.get(i)
            if new is None or new.shape != g.shape or new.dtype != g.dtype or new.device != g.device:
                new = self._spare[i] = torch.empty_like(g)
            velocity = self.velocity.get(i)
            if velocity is not None and velocity is self._following.get(i):
                # Restarting from the buffer an idle step left (_follow). With
                # weight decay B is the correction's own from here, taken
                # before the optimizer's step moves the buffer. The velocity
                # becomes a copy of this rank's too: the optimizer's step
                # moves the buffer in place, and a clip seen at that step
                # (_follow_scale) needs the old velocity as it was.
                if self.applied.get(i) is velocity and i not in self._borrowed:
                    self._note("applied", i, self.applied)
                    self.applied[i] = velocity.clone()
                velocity = self.velocity[i] = velocity.clone()
            if velocity is None or self.applied.get(i) is None:
                new.copy_(g)  # torch's first step: buf = grad, no dampening
                self._note("applied", i, self.applied)
                self.applied[i] = None
            else:
                velocity = self.velocity[i] = velocity.to(g.device, g.dtype)
                if d:
                    torch.mul(velocity, m, out=new).add_(g, alpha=1.0 - d)
                else:
                    torch.add(g, velocity, alpha=m, out=new)
            if nesterov:
                g.add_(new, alpha=m)
            else:
                g.copy_(new)
            work.append((i, a, b, m, d, nesterov))
        return work or None

    def after(self, work, result):
        """With the reduced average S in ``result``: keep the new velocities
        and write in each corrected slot the G on which the optimizer's own
        momentum lands on S. A bucket that came back non-finite (the library
        skipped the step) keeps the velocities as they were."""
        # A sum is one read; isfinite over the bucket is many times slower
        # on a CPU. A finite sum that overflows is checked exactly.
        if not bool(torch.isfinite(result.sum())) and not bool(torch.isfinite(result).all()):
            if self._folds is not None:
                self._folds.skipped()  # the step is void: the other buckets' velocities go back
            return result
        for i, a, b, m, d, nesterov in work:
            self._note("velocity", i, self.velocity)
            self.velocity[i], self._spare[i] = self._spare[i], self.velocity.get(i)
            if self._spare[i] is None or self._spare[i] is self._following.get(i):
                del self._spare[i]  # the optimizer's buffer is never a spare
            # What left this rank (with "waited": after waiting) stops its
            # momentum. A dense step sends everything: True masks all,
            # "waited" nothing (it delivers what waited).
            self.mask.after(i, self.velocity[i])
            s = result[a:b]
            before = self.applied[i]
            if before is not None:
                before = self.applied[i] = before.to(s.device, s.dtype)
            if before is None:
                if nesterov:
                    s.div_(1.0 + m)
            elif nesterov:
                s.sub_(before, alpha=m * m).div_(1.0 + m)
            else:
                s.sub_(before, alpha=m)
                if d:
                    s.div_(1.0 - d)
            self._handed[i] = (m, 0.0 if nesterov else d)
        # Two slots a step, so as to add few reads to the step: the step's
        # first corrected slot, and the lowest-numbered corrected parameter
        # wherever DDP's buckets put it (they are rebuilt after the first
        # step). The clip's factor is read from the latter, so a resumed run
        # reads the same factor as the uninterrupted one; two tensors tell a
        # change per tensor from one factor on all.
        lowest = min(self.settings) if self.settings else None
        first = [] if self._samples else [work[0][:3]]
        for i, a, b in {*first, *(w[:3] for w in work if w[0] == lowest)}:
            magnitude = result[a : a + min(b - a, self.SAMPLE_SPAN)].abs()
            if magnitude.numel() and float(magnitude.max()) > 0:
                # The largest and the smallest nonzero: a clip by value
                # (clip_grad_value_) moves the one and not the other.
                for j in dict.fromkeys((int(magnitude.argmax()), int(torch.where(magnitude > 0, magnitude, math.inf).argmin()))):
                    self._samples.append((i, j, result[a + j].item()))
        return result

    # -- checkpoints -------------------------------------------------------

    def state_dict(self):
        """Each parameter's settings, velocity and B (on the CPU), by
        canonical index: a resumed run corrects its first step as this one
        would have, before its optimizer has stepped."""
        def cpu(t):
            return None if t is None else t.detach().cpu().clone()

        return {i: {"settings": self.settings[i], "velocity": cpu(self.velocity.get(i)), "applied": cpu(self.applied.get(i)),
                    "waiting": self.mask.waiting(i)}
                for i in sorted(self.settings)}

    def load_state_dict(self, saved):
        self.settings = {int(i): tuple(e["settings"]) for i, e in saved.items()}
        self.velocity = {int(i): e["velocity"] for i, e in saved.items() if e["velocity"] is not None}
        self.applied = {int(i): e["applied"] for i, e in saved.items()}
        self.mask.load({int(i): e["waiting"] for i, e in saved.items() if e.get("waiting") is not None})
        self._spare, self._handed, self._samples, self._borrowed, self._following, self._followed = {}, {}, [], set(), {}, {}
        self._optimizer, self._group_of = None, {}
        self._record = None  # a loaded state is no step's to give back

