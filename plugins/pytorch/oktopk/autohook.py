"""The one line, added for the script: run a training script unchanged,
with oktopk's hook on every ``DistributedDataParallel`` it builds.

``python -m oktopk.run`` launches a script as torchrun does and runs each
rank through this module; under another launcher (mpirun, srun, or
torchrun itself) run it directly::

    torchrun --nproc-per-node 4 -m oktopk.autohook train.py --epochs 3
    mpirun -n 4 python -m oktopk.autohook train.py --epochs 3
    srun python -m oktopk.autohook -m my_package.train

What it does: before the script runs, ``DistributedDataParallel`` learns
to register ``oktopk_hook`` with ``OkTopkState(process_group=the module's
group, **settings)`` at its first forward. Why the first forward and not
its construction: DDP takes one comm hook, once, and frameworks register
their own after building the module (Lightning's ``ddp_comm_hook``,
Accelerate's ``comm_hook``, a script's ``register_comm_hook``); by the
first forward every such registration has happened, so a module that has
a hook of its own keeps it, and oktopk says so.

Under horovodrun, where ``oktopk_horovod`` is installed, the same goes
for ``hvd.DistributedOptimizer``: one built with Horovod's default
compression (none) is ``oktopk_horovod.DistributedOptimizer`` with
``Compression.oktopk`` and the settings below; one given a compression of
its own (``hvd.Compression.fp16``), or options the sparse optimizer has no
counterpart for (``num_groups``, ``groups``, another process set), is left
as it is, and oktopk says so.

Settings: every ``OkTopkState`` setting, by its flat name
(``oktopk.settings.FLAT``), from an ``OKTOPK_<NAME>`` variable (``OKTOPK_DENSITY=0.02``,
``OKTOPK_DENSE_COMPRESSION=quantized``), read as a Python literal where
it is one, else as text. Rank 0 prints once what was switched on and
where, or that nothing was.
"""

import ast
import atexit
import os
import runpy
import sys

PREFIX = "OKTOPK_"

# Each module registered, with its state: (module, OkTopkState); a script
# or a test reads the statistics from the states.
registered = []
_seen = {"modules": 0, "kept": 0}


def settings_from_env(environ=None):
    """The OkTopkState arguments set by OKTOPK_<NAME> variables; ValueError
    naming a variable whose value the state refuses."""
    from .settings import FLAT
    from .state import OkTopkState

    environ = os.environ if environ is None else environ
    settings = {}
    for name in FLAT:  # every setting by its flat name
        text = environ.get(PREFIX + name.upper())
        if text is None:
            continue
        try:
            settings[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            settings[name] = text  # a word: "quantized", "oktopk"
    try:
        OkTopkState(**settings)  # refused here, before the script runs, with the setting's name
    except ValueError as e:
        raise ValueError(f"oktopk: the {PREFIX}* settings are refused: {e}") from None
    return settings


def _rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):  # torchrun, horovodrun, mpirun, srun
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _say(text):
    if _rank() == 0:
        print(f"oktopk: {text}", file=sys.stderr, flush=True)


def install(settings=None):
    """Make every DistributedDataParallel built from now on register
    oktopk_hook at its first forward, unless it has a comm hook already.
    Idempotent."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "_oktopk_autohook", False):
        return
    settings = dict(settings or {})
    forward = DDP.forward
    builtin = DDP._register_builtin_comm_hook

    def register_builtin(self, comm_hook_type):
        self._oktopk_builtin_hook = comm_hook_type
        return builtin(self, comm_hook_type)

    def first_forward(self, *inputs, **kwargs):
        if not getattr(self, "_oktopk_checked", False):
            self._oktopk_checked = True
            _seen["modules"] += 1
            _attach(self, settings)
        return forward(self, *inputs, **kwargs)

    DDP.forward = first_forward
    DDP._register_builtin_comm_hook = register_builtin
    DDP._oktopk_autohook = True
    _install_horovod(settings)
    atexit.register(_say_if_nothing)


def _install_horovod(settings):
    """Where Horovod and oktopk_horovod are installed: hvd.DistributedOptimizer
    builds oktopk_horovod's with Compression.oktopk(settings), unless the
    script chose a compression or options of its own."""
    import importlib.util

    if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("oktopk_horovod") is None:
        return
    import horovod.torch as hvd
    import oktopk_horovod

    from .settings import Settings

    plain = hvd.DistributedOptimizer
    try:
        compression, refused = oktopk_horovod.Compression.oktopk(settings=Settings.from_flat(**settings)), None
    except ValueError as e:  # a setting Horovod's optimizer cannot honour: refused if the script builds one
        compression, refused = None, e

    def DistributedOptimizer(optimizer, named_parameters=None, **kwargs):
        kwargs.setdefault("compression", hvd.Compression.none)
        own = []
        if kwargs["compression"] is not hvd.Compression.none:
            own.append(f"compression={getattr(kwargs['compression'], '__name__', kwargs['compression'])}")
        own += [f"{name}={kwargs[name]!r}" for name in ("num_groups", "groups") if kwargs.get(name)]
        if kwargs.get("process_set", hvd.global_process_set) is not hvd.global_process_set:
            own.append("a process set of its own")
        _seen["modules"] += 1
        if own:
            _seen["kept"] += 1
            _say(f"hvd.DistributedOptimizer({type(optimizer).__name__}) has {', '.join(own)}: left as it is")
            return plain(optimizer, named_parameters=named_parameters, **kwargs)
        if refused is not None:
            raise ValueError(f"oktopk: the {PREFIX}* settings are refused for hvd.DistributedOptimizer: {refused}") from None
        kwargs["compression"] = compression
        opt = oktopk_horovod.DistributedOptimizer(optimizer, named_parameters=named_parameters, **kwargs)
        registered.append((opt, opt))
        chosen = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        _say(f"Compression.oktopk({chosen}) is on for hvd.DistributedOptimizer({type(optimizer).__name__}) over "
             f"{hvd.size()} ranks")
        return opt

    DistributedOptimizer.__doc__ = plain.__doc__
    hvd.DistributedOptimizer = DistributedOptimizer


def _attach(module, settings):
    from . import oktopk_hook
    from .state import OkTopkState

    theirs = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(module, "_comm_hooks", [])]
    if getattr(module, "_oktopk_builtin_hook", None) is not None:
        theirs.append(str(module._oktopk_builtin_hook))
    name = type(module.module).__name__
    if theirs:
        _seen["kept"] += 1
        if not any(getattr(hook, "__module__", "").startswith("oktopk") for hook, _ in getattr(module, "_comm_hooks", [])):
            _say(f"DistributedDataParallel({name}) has its own comm hook ({', '.join(theirs)}): left as it is")
        return
    state = OkTopkState(process_group=module.process_group, **settings)
    module.register_comm_hook(state, oktopk_hook)
    registered.append((module, state))
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    _say(f"oktopk_hook is on for DistributedDataParallel({name}), {params:,} parameters over {module.process_group.size()} ranks: {state!r}")


def _say_if_nothing():
    if not registered and not _seen["kept"]:
        _say("the script built no DistributedDataParallel (or never ran one forward) and no hvd.DistributedOptimizer, "
             "so nothing was switched on; FSDP2 takes oktopk in one line of its own (docs/ways-in.md)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # torchrun without --use-env passes --local-rank first; it belongs to the script.
    local_rank = [a for a in argv[:1] if a.startswith("--local-rank") or a.startswith("--local_rank")]
    argv = argv[len(local_rank):]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        install(settings_from_env())
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print("oktopk: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = [argv[1]] + local_rank + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = [script] + local_rank + argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
