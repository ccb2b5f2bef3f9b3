"""oktopk's hook under training frameworks that build the DDP module
themselves (docs/frameworks.md).

- ``OkTopkCallback(trainer, **settings)``: Hugging Face Transformers'
  ``Trainer`` builds its ``DistributedDataParallel`` inside ``train()`` and
  takes no comm hook; this callback registers ``oktopk_hook`` on
  ``trainer.model_wrapped`` at ``on_train_begin`` and keeps each rank's
  state in Trainer's checkpoints::

      trainer.add_callback(OkTopkCallback(trainer))

- ``OkTopkLightningCallback(state)``: beside PyTorch Lightning's
  ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=oktopk_hook)``, puts
  every rank's state in Lightning's checkpoint and gives each rank its own
  back on resume; and registers the hook on CPU, where DDPStrategy drops
  its ``ddp_comm_hook`` (it registers one on CUDA only).
- ``EveryRank(state)``: the same for any framework that saves one file
  from rank 0 but asks every rank for its ``state_dict()``; Accelerate's
  ``accelerator.register_for_checkpointing(EveryRank(state))``.

Why every rank's: a rank's residuals are its own unsent gradients, and a
state of another rank is refused on load (``oktopk.checkpoint``), while
these frameworks write a checkpoint from rank 0 alone. The framework
packages are imported only when the class that needs one is first used.
"""

import os
import warnings

import torch
import torch.distributed as dist

from .ddp import OkTopkState, oktopk_hook

__all__ = ["EveryRank", "OkTopkCallback", "OkTopkLightningCallback"]


def _rank_and_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


class EveryRank:
    """Every rank's ``OkTopkState`` in one checkpoint. ``state_dict()`` is
    collective: each rank calls it (Accelerate's ``save_state`` and
    Lightning's checkpointing do, then write rank 0's result alone), and rank
    0's holds the list of every rank's state. ``load_state_dict`` takes that
    list on every rank and loads the rank's own entry. Gathered to rank 0
    alone, so that no other rank holds every residual: a file written by
    another rank (Accelerate's ``save_on_each_node``, on the other nodes)
    holds that rank's state alone, and a load of it is refused, naming the
    numbers of ranks."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        group = self.state.process_group
        rank, size = _rank_and_size(group)
        mine = self.state.state_dict()
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return {"oktopk_every_rank": gathered if rank == 0 else [mine]}

    def load_state_dict(self, saved):
        states = saved["oktopk_every_rank"]
        rank, size = _rank_and_size(self.state.process_group)
        if len(states) != size:
            raise ValueError(f"oktopk: this checkpoint holds the states of {len(states)} ranks and this run has {size}: "
                             "each rank's residuals are its own. Resume with the same number of ranks, or leave the "
                             "oktopk state out of the load (its residuals then start afresh).")
        self.state.load_state_dict(states[rank])


_classes = {}


def _trainer_callback_class():
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import TrainerCallback

    class OkTopkCallback(TrainerCallback):
        """Registers ``oktopk_hook`` on the ``DistributedDataParallel`` that
        Trainer built (``trainer.model_wrapped``) when training begins, with
        ``OkTopkState(process_group=its group, **settings)``; saves each
        rank's state into Trainer's checkpoint folder
        (``oktopk_state_{rank}.pt``, beside Trainer's own
        ``rng_state_{rank}.pth``) and, on a resumed run, loads it from the
        folder of the step Trainer resumed at
        (``output_dir/checkpoint-{global_step}``), so that the run continues
        as the uninterrupted one would. ``self.state`` is the state, once
        registered."""

        def __init__(self, trainer, **settings):
            self.trainer = trainer
            self.settings = settings
            self.state = None
            OkTopkState(**settings)  # a bad setting is refused here, not at train()

        def on_train_begin(self, args, state, control, **kwargs):
            module = self.trainer.model_wrapped
            if not isinstance(module, DDP):
                warnings.warn(f"oktopk: Trainer trains {type(module).__name__}, not a DistributedDataParallel "
                              "(one process, or FSDP/DeepSpeed): the hook is not registered")
                return
            if self.state is None or not any(h is oktopk_hook for h, _ in getattr(module, "_comm_hooks", [])):
                self.state = OkTopkState(process_group=module.process_group, **self.settings)
                module.register_comm_hook(self.state, oktopk_hook)
            if state.global_step > 0:  # a resumed run: Trainer has loaded its checkpoint's trainer state
                path = self._path(args, state.global_step)
                if os.path.exists(path):
                    self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
                else:
                    warnings.warn(f"oktopk: training resumes at step {state.global_step} and {path} is missing: "
                                  "the hook's residuals start afresh, so the run differs from the uninterrupted one")

        def on_save(self, args, state, control, **kwargs):
            if self.state is not None:
                torch.save(self.state.state_dict(), self._path(args, state.global_step))

        def _path(self, args, step):
            rank = dist.get_rank(self.state.process_group)
            return os.path.join(args.output_dir, f"checkpoint-{step}", f"oktopk_state_{rank}.pt")

    return OkTopkCallback


def _lightning_callback_class():
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback

    class OkTopkLightningCallback(Callback):
        """For ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=oktopk_hook)``
        (pass it the same state): every rank's state in Lightning's
        checkpoint (under ``callbacks``), each rank's own loaded back on
        ``fit(ckpt_path=...)``; and the hook registered at ``on_fit_start``
        where the strategy registered none. DDPStrategy registers its
        ``ddp_comm_hook`` only when the root device is CUDA (Lightning 2.6's
        ``_register_ddp_hooks``) and drops it on CPU without a word; with
        this callback the hook is on either way (``state.registered_by``
        says which: "DDPStrategy" or "OkTopkLightningCallback")."""

        def __init__(self, state):
            self.state = state
            self.every_rank = EveryRank(state)
            self.registered_by = None

        def on_fit_start(self, trainer, pl_module):
            module = trainer.strategy.model
            if not isinstance(module, DDP):
                warnings.warn(f"oktopk: Lightning trains {type(module).__name__}, not a DistributedDataParallel "
                              "(DDPStrategy): the hook is not registered")
                return
            hooks = [h for h, _ in getattr(module, "_comm_hooks", [])]
            if any(h is oktopk_hook for h in hooks):
                self.registered_by = "DDPStrategy"
            elif hooks:
                warnings.warn(f"oktopk: Lightning's DDP module has another comm hook ({hooks[0]!r}): left as it is")
            else:
                module.register_comm_hook(self.state, oktopk_hook)
                self.registered_by = "OkTopkLightningCallback"

        def state_dict(self):
            return self.every_rank.state_dict()

        def load_state_dict(self, state_dict):
            self.every_rank.load_state_dict(state_dict)

    return OkTopkLightningCallback


_makers = {"OkTopkCallback": _trainer_callback_class, "OkTopkLightningCallback": _lightning_callback_class}


def __getattr__(name):
    if name in _makers:
        if name not in _classes:
            _classes[name] = _makers[name]()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
