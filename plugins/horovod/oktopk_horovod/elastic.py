"""horovodrun's elastic mode with oktopk's optimizer: ``State`` is
``hvd.elastic.TorchState`` for a model stepped by
``oktopk_horovod.DistributedOptimizer``::

    state = oktopk_horovod.elastic.State(model, optimizer, checkpoint_dir=DIR, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            ...  # forward, backward, optimizer.step()
            state.step += 1
            state.commit()

What it adds to TorchState, and why:

* The optimizer's own state (momentum buffers) is saved and restored as
  TorchState does, and broadcast from rank 0 after a reset without the
  zero-gradient step TorchState takes to fill a fresh optimizer's state
  (that step would go through oktopk's exchange on the new worker alone).
* Each rank's oktopk state (residuals, thresholds, velocities, the step
  count: ``oktopk_state_dict()``) is saved at every commit, in memory and,
  with ``checkpoint_dir``, in a file of that rank's, so a worker that
  horovodrun starts again in a lost one's place resumes it. After every
  reset the optimizer starts a new engine over the ranks as they are now
  (its communicator made afresh) and loads those states where every rank
  holds one of its own rank, of this world size and of the last commit:
  the run then goes on as an uninterrupted one would from that commit.
  Where some rank holds none (a new rank, the world's size changed, or
  commits were made at another size since), every rank starts with empty
  residuals, and ``resets_without_state`` counts the resets where some
  rank's state was dropped: what those residuals held is lost.
* A lost or silent rank fails the step's library call with ``OkTopkError``;
  the optimizer raises it as Horovod's ``HorovodInternalError``, which
  ``hvd.elastic.run`` recovers from.
"""

import copy
import os

import horovod.torch as hvd
import torch


class State(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState(model, **kwargs)`` with ``optimizer``, an
    ``oktopk_horovod.DistributedOptimizer``, kept as the module's text
    says; ``checkpoint_dir``: where each rank's oktopk state of the last
    commit is written (None: in memory only, lost with its process)."""

    def __init__(self, model=None, optimizer=None, checkpoint_dir=None, **kwargs):
        self._oktopk_optimizer = optimizer
        self._checkpoint_dir = checkpoint_dir
        self._optimizer_saved = copy.deepcopy(optimizer.state_dict())
        self._oktopk_saved = self._read_file()
        self.resets_without_state = 0
        self.commits = 0  # commits made, rank 0's after every sync
        self.last_restart = None  # what the last sync did with the oktopk states: "loaded", "empty" or "dropped"
        super().__init__(model=model, **kwargs)

    def _path(self):
        return os.path.join(self._checkpoint_dir, f"oktopk-rank{hvd.rank()}-of{hvd.size()}.pt")

    def _read_file(self):
        if self._checkpoint_dir is None or not os.path.exists(self._path()):
            return None
        return torch.load(self._path(), weights_only=False)

    def save(self):
        opt = self._oktopk_optimizer
        self._optimizer_saved = copy.deepcopy(opt.state_dict())
        self.commits += 1
        self._oktopk_saved = None
        if opt.started:
            self._oktopk_saved = {"commit": self.commits, "state": opt.oktopk_state_dict()}
            if self._checkpoint_dir is not None:
                os.makedirs(self._checkpoint_dir, exist_ok=True)
                tmp = self._path() + ".tmp"
                torch.save(self._oktopk_saved, tmp)
                os.replace(tmp, self._path())  # a kill during the write leaves the last whole one
        super().save()

    def restore(self):
        self._oktopk_optimizer.load_state_dict(self._optimizer_saved)
        super().restore()

    def sync(self):
        super().sync()  # the model's parameters and the plain attributes, from rank 0
        opt = self._oktopk_optimizer
        state = hvd.broadcast_object(opt.state_dict() if hvd.rank() == 0 else None, root_rank=0,
                                     name="oktopk.elastic.optimizer")
        opt.load_state_dict(state)
        # Only a state of the last commit goes with the parameters just
        # synced: rank 0's count of commits says which that is.
        self.commits = hvd.broadcast_object(self.commits, root_rank=0, name="oktopk.elastic.commits")
        saved = self._oktopk_saved
        if saved is None or saved["state"].get("rank") != hvd.rank() or saved["state"].get("world_size") != hvd.size():
            saved = self._read_file()  # a worker started again in a lost one's place
        held = saved is not None
        if held and saved["commit"] != self.commits:
            saved = None
        self.last_restart = opt.oktopk_restart(None if saved is None else saved["state"], held=held)
        if self.last_restart == "dropped":
            self.resets_without_state += 1
        self._oktopk_saved = None  # used or dropped: the next commit saves anew
