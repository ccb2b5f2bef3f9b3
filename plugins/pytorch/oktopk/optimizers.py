"""Which optimizer steps the parameters a front end reduces, and why the
default keeps Adam-family ones dense.

Error feedback keeps the gradient's mass: an entry that waits in the
residual for ~1/density steps is finally sent as the sum of those steps.
SGD applies that sum in full; Adam divides every coordinate by the root of
its running mean square, and every remedy measured for that (freezing the
second moment after a dense warm-up as 1-bit Adam does, selecting in the
preconditioned space, small tensors dense, local steps, bounded staleness)
left a transformer trained with AdamW far above dense at a tenth of dense's
bytes, as it left PowerSGD (results/text.md). So with ``algorithm=None`` a
front end that sees an Adam-family optimizer step its parameters keeps the
framework's dense allreduce, and says so once; naming an algorithm sends
sparse whatever the optimizer, with a warning. The dense allreduce's values
travel in float32, or compressed where the measured step says that is
faster (DDP and FSDP2, oktopk.choice, their ``dense_compression``): by
default quantized to 4 bits with error feedback (oktopk.quantized), 0.14
of float32's bytes, whose mean over seeds stayed within dense AdamW's
spread on a character-level transformer and a BERT-style encoder, each
at its best learning rate (results/text.md); or in bfloat16 or float16.

An optimizer is Adam-family when its defaults hold ``betas`` (Adam, AdamW,
NAdam, RAdam, Adamax, SparseAdam, and the fused and third-party variants
built the same way): the per-coordinate second moment is what turns a
residual's burst into one ordinary step.
"""

import threading
import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .momentum import MOMENTUM_OPTIMIZER


def adam_family(optimizer):
    """The optimizer's class name if it is Adam-family, else None."""
    defaults = getattr(optimizer, "defaults", None)
    if isinstance(defaults, dict) and "betas" in defaults:
        return type(optimizer).__name__
    return None


def family_seen(name):
    """What the ranks compare of the optimizer that steps the parameters
    (oktopk.settings.check_agreement): the family, which decides the
    paths, with the Adam-family one's name."""
    return f"Adam-family ({name})" if name is not None else "not Adam-family"


def sparse_warning(name):
    return (f"oktopk: {name} steps these parameters and an algorithm was named, so their gradients are sent sparse; "
            "with Adam-family optimizers sparse gradients ended far above dense in every measurement (docs/tuning.md). "
            "algorithm=None keeps the dense allreduce for them.")


# The one line that replaces an Adam-family optimizer (oktopk.optim) in a
# DDP script (a front end may name its own: Horovod's, in place of
# hvd.DistributedOptimizer).
DEMO_LINE = "opt = oktopk.optim.DeMo(model, lr=3e-3, weight_decay=0.01)"

# The hooks of watches the garbage collector took, removed when the next
# watch is made. The collector may run inside an optimizer's step, while
# torch iterates over its global hooks, and removing one there raises
# "OrderedDict mutated during iteration" in the user's step. Until then they
# do nothing: they hold only a weak reference to their watch.
_orphaned_hooks = []


def dense_notice(name, compressed=None, demo_line=DEMO_LINE):
    """``compressed``: the path measured against float32 (oktopk.choice), or
    None; ``demo_line``: the script's line that switches to DeMo."""
    from .paths import PATHS  # here: the paths' modules import the engine's, which import this one

    how = f"in float32, or {PATHS[compressed].described} where a step measures faster" if compressed else "in float32"
    return (f"oktopk: {name} steps these parameters: the hook keeps the process group's dense allreduce, {how} "
            "(with Adam-family optimizers sparse gradients ended far above dense in every measurement, docs/tuning.md). "
            f"To send about 1% of the bytes instead, change the optimizer's line: {demo_line} "
            "(DeMo over Ok-Topk; its learning rate wants its own sweep, docs/optim.md)")



class OptimizerWatch:
    """Notes the first Adam-family optimizer that steps any of the watched
    parameters, through torch's global optimizer step pre-hook. The hook
    holds only a weak reference to the watch and is removed by ``close``
    (not from inside itself: torch iterates its hooks while calling them),
    or, for a watch the garbage collector took, when the next is made.
    ``warn``: warn once when seen (a named algorithm). ``on_momentum``:
    called with every torch.optim.SGD that steps watched parameters, after
    each of its steps (oktopk.momentum). ``void(optimizer, watched)``:
    called before every step of an optimizer that steps watched parameters
    (``watched``: their ids); True when it voided the step (a rank was
    lost in it: oktopk.continuing), which then reaches no correction."""

    def __init__(self, warn=False, on_momentum=None, void=None):
        self._handle = None
        self.seen = None  # the Adam-family optimizer's class name
        self.warn = warn
        self.on_momentum = on_momentum
        self.void = void
        self._voided = weakref.WeakKeyDictionary()  # optimizer -> its step under way was voided
        self._params = set()  # id() of the watched parameters
        self._verdicts = weakref.WeakKeyDictionary()  # optimizer -> steps watched parameters?
        self._lock = threading.Lock()
        while _orphaned_hooks:
            _orphaned_hooks.pop().remove()
        ref = weakref.ref(self)

        def pre_step(optimizer, args, kwargs):
            watch = ref()
            if watch is not None:
                watch._on_step(optimizer)

        self._handle = register_optimizer_step_pre_hook(pre_step)
        self._post_handle = None
        if on_momentum is not None:
            def post_step(optimizer, args, kwargs):
                watch = ref()
                if watch is not None:
                    watch._after_step(optimizer)

            self._post_handle = register_optimizer_step_post_hook(post_step)

    def watch(self, params):
        """Add parameters (tensors) to those watched."""
        if self._handle is None:
            return
        with self._lock:
            new = {id(p) for p in params} - self._params
            if new:
                self._params |= new
                self._verdicts = weakref.WeakKeyDictionary()  # an optimizer may step the new ones

    def _steps_watched(self, optimizer):
        """Whether the optimizer steps any watched parameter (cached per
        optimizer)."""
        with self._lock:
            try:
                verdict = self._verdicts.get(optimizer)
            except TypeError:  # not weakly referenceable: judge every step
                verdict = None
            if verdict is None:
                verdict = any(id(p) in self._params for group in optimizer.param_groups for p in group["params"])
                try:
                    self._verdicts[optimizer] = verdict
                except TypeError:
                    pass
            return verdict

    def _on_step(self, optimizer):
        if self.void is not None and self._steps_watched(optimizer):
            self._voided[optimizer] = self.void(optimizer, self._params)
        if self.seen is not None:
            return
        name = adam_family(optimizer)
        if name is None or not self._steps_watched(optimizer):
            return
        with self._lock:
            if self.seen is not None:
                return
            self.seen = name
        if self.warn:
            warnings.warn(sparse_warning(name), stacklevel=3)

    def _after_step(self, optimizer):
        if self._voided.get(optimizer):
            return
        if isinstance(optimizer, MOMENTUM_OPTIMIZER) and self._steps_watched(optimizer):
            self.on_momentum(optimizer)

    def close(self):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if getattr(self, "_post_handle", None) is not None:
            self._post_handle.remove()
            self._post_handle = None

    def __del__(self):
        for handle in (self._handle, getattr(self, "_post_handle", None)):
            if handle is not None:
                _orphaned_hooks.append(handle)
