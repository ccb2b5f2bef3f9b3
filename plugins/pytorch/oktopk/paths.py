"""The ways to reduce: one module per way (``path_<name>.py``), one line per
way in :data:`_MODULES`. The engine (``oktopk.engine``) looks each step's
path up in :data:`PATHS` by the name the measured choice (``oktopk.choice``)
or the settings give it; no front end names a path.

Every way is a :class:`Path`, with the same methods: a reduce (of a DDP
bucket, and of an FSDP2 shard), and a fold that does nothing by default.
A way that keeps residuals (error feedback) overrides ``holds`` and the
folds, which move what it holds into the values before a step of another
way, so a switch of path loses nothing.

Adding a way: write ``path_<name>.py`` with a ``Path`` subclass bound to
``PATH``, and add ``"<name>"`` to :data:`_MODULES`. A dense way whose
``compresses_dense`` is True can then be named as ``dense_compression``
and ``warmup_compression`` (``path_fp16.py`` was added so).
"""

import importlib

import torch

# The bucket dtypes liboktopk reduces; the dense warm-up would take others,
# so they are refused on the first hook call rather than at the first sparse
# step.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Path:
    """A way of reducing one DDP bucket or one FSDP2 shard to its average
    over the process group's ranks. ``engine`` is the ``oktopk.engine.Engine``
    whose step it is; ``step`` is the engine's ``iter`` when the step began."""

    name = None
    # May stand in for sparse under an Adam-family optimizer, and compress
    # the warm-up (dense_compression, warmup_compression): a dense way that
    # sends every value every step.
    compresses_dense = False
    # Keeps residuals between steps (error feedback): the engine never
    # points .grad at the bucket for it (the bucket is not the average alone).
    keeps_residual = False
    # How it sends values, in a sentence's words ("in bfloat16"): the notice
    # that names the path the measured choice weighs under Adam says so.
    described = None

    def reduce(self, engine, bucket, tensor, step):
        """DDP: the future of the average over the ranks of ``tensor``
        (``bucket.buffer()``, this rank's undivided gradients), written into
        it; the future DDP waits on."""
        raise NotImplementedError

    def reduce_shard(self, engine, group_id, shard, step):
        """FSDP2: the module's gradient shard (its residuals kept under
        ``group_id``) replaced, in place, by its average over the replicas."""
        raise NotImplementedError

    def holds(self, engine):
        """Whether this way holds anything a step of another way must fold
        in first."""
        return False

    def watches(self, engine):
        """Whether this way's fold must see each bucket of another way's
        step (it holds something, or tracks what the bucket carries)."""
        return self.holds(engine)

    def fold(self, engine, bucket, tensor, step):
        """Before a step of another way: what this way holds for the bucket's
        parameters joins ``tensor``. Returns None, or the bucket's future
        when the fold had to reduce the bucket itself (the bucket does not
        match the groups its residuals are kept in)."""
        return None

    def fold_shard(self, engine, group_id, shard):
        """:meth:`fold` for an FSDP2 shard, in place."""

    def __repr__(self):
        return f"<path {self.name}>"


# The ways, in the order their folds run before another way's step.
_MODULES = (
    "native",
    "bf16",
    "fp16",
    "quantized",
    "sparse",
)

PATHS = {}
for _module in _MODULES:
    _path = importlib.import_module(f"{__package__}.path_{_module}").PATH
    assert isinstance(_path, Path) and _path.name == _module, (_module, _path)
    PATHS[_path.name] = _path

# The names the engine itself reads: the measured choice's two sides.
NATIVE = PATHS["native"].name
SPARSE = PATHS["sparse"].name
DENSE_COMPRESSIONS = tuple(name for name, path in PATHS.items() if path.compresses_dense)



def __getattr__(name):
    # What lived here before the engine, named where it went.
    moved = {"warmup_path": "oktopk.engine.warmup_path(warmup, step), or OkTopkState.warmup_path(step)",
             "timed_warmup_step": "oktopk.engine.timed_warmup_step(warmup), or OkTopkState.timed_warmup_step()"}
    if name in moved:
        raise AttributeError(f"oktopk.paths.{name} moved to the engine: {moved[name]} (oktopk.engine)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
