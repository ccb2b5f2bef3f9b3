"""Momentum factor masking (Lin et al., Deep Gradient Compression, ICLR
2018), for the momentum correction (``oktopk.momentum``): zero this rank's
velocity where its entry was sent, so its momentum does not keep pushing
what was already delivered.

Which entries left is read from the residual after the call: a sent
entry's residual is exactly 0 (float32 values; 16-bit ones leave the
rounding there, so masking refuses them). On the host path the residual is
the library's, read in one pass (``Communicator.residual_zeros``, on the
worker thread in issue order); on the device path it is the DeviceGroup's.

- ``True``, DGC's rule: every entry that left. A dense step (the warm-up
  once the correction runs, the measured choice's native steps, a dense
  algorithm) sends every entry and zeroes every velocity, so at density 1
  it is SGD without momentum.
- ``"waited"``: only an entry that left after waiting (it was still in the
  residual after the previous call). Such an entry arrives as a burst of
  several steps' velocity steps, the burst DGC's masking means to stop; an
  entry sent on consecutive calls moves as in dense SGD, and a dense step
  masks nothing, so at density 1 (nothing ever waits) it is dense SGD with
  momentum, bit for bit. Either rule drops the masked velocity's future
  pushes, about m/(1 − m) of its step: on the short, constant-rate MLP run
  that damping helps, on the longer CNN run it costs accuracy.
- Over the first n steps with a sparse call only (``steps``): the default
  masks "waited" entries over the first 100
  (``oktopk.settings.AUTO_MASKING_STEPS``), where an entry first arrives as
  a burst (after its 4-bit early steps VGG-16 fell back to chance without
  it), and not after, where the damping costs the CNN. After the window a
  sparse call is only counted: no pass reads its residual.
- A clip after backward is followed as without masking, and an entry the
  mask zeroed stays zero (``MomentumCorrection._follow_scale``).
"""

import itertools

import torch


def zero_where(velocity, masked):
    """Zero ``velocity`` where ``masked`` says: True (every entry), a bool
    mask, or int64 positions."""
    if masked is True:
        velocity.zero_()
    elif masked.dtype == torch.bool:
        velocity.masked_fill_(masked, 0.0)
    else:
        velocity.index_fill_(0, masked, 0.0)


class Masking:
    """The masking of one MomentumCorrection, keyed by the layout's
    canonical parameter index. ``note(what, key, table)`` records a change
    to the ``zero`` or ``loaded`` table for a step that turns out void to
    give back (MomentumCorrection._note)."""

    def __init__(self, rule=False, steps=None, note=None):
        self.rule = rule  # False, True or "waited"
        # How many steps with a sparse call the masking acts on, from the
        # first (None: all of them), and how many there have been so far.
        self.steps = steps
        self.sparse_steps = 0
        self._note = note or (lambda what, key, table: None)
        self._sent = False  # this step made a sparse call (note_sent)
        # index -> the entries whose velocity ``after`` zeroed this step (a
        # bool mask, or positions), for a clip seen at the optimizer's step
        # to leave them zero.
        self.masked = {}
        # index -> the entries whose velocity this step's sparse call stops:
        # True, a bool mask of those it took from this rank; "waited", the
        # positions (ascending int64, about k) of those that left after
        # waiting. Written by the worker thread after the call, read by
        # ``after``; cleared at each step's first bucket.
        self._left = {}
        # group id -> bool marks of the entries whose residual was 0 after
        # the group's latest sparse call ("waited"): those it took and those
        # that held nothing. An entry unmarked then and taken now had
        # waited: it arrives as a burst of several steps' velocity; one sent
        # on consecutive calls is moved as dense SGD moves it. Absent:
        # nothing waited (no sparse call yet, or a dense step since).
        self.zero = {}
        self._buffers = {}  # group id -> (the marks' spare, the int64 list): the host path's, reused
        self._member_of = {}  # index -> (group id, offset, size) at the latest sparse call
        self.loaded = {}  # index -> a checkpoint's mask of entries still waiting, until its group's next call

    @property
    def now(self):
        """This step's rule: ``rule`` until ``steps`` steps have made a
        sparse call, False after."""
        if self.steps is not None and self.sparse_steps >= self.steps:
            return False
        return self.rule

    def begin_step(self):
        """At the step's first bucket: count the step before if it made a
        sparse call."""
        self._left = {}
        self.masked = {}
        if self._sent:
            self._sent = False
            self.sparse_steps += 1
            if self.rule and not self.now:  # the window is over: its marks are read no more
                self.zero, self.loaded = {}, {}

    def after(self, i, velocity):
        """Parameter ``i``'s new ``velocity``, kept by the correction: zero
        what this step's call delivered, by this step's rule."""
        rule = self.now
        if not rule:
            return
        left = self._left.pop(i, None)
        if left is None and rule == "waited":
            # A dense step sends everything and delivers what waited: no
            # entry waits after it.
            group_id = self._member_of.get(i, (None,))[0]
            if group_id in self.zero:
                self._note("zero", group_id, self.zero)
                del self.zero[group_id]
            if i in self.loaded:  # a resumed run's dense step, before its group's first sparse call
                self._note("loaded", i, self.loaded)
                del self.loaded[i]
        else:
            left = self.masked[i] = True if left is None else left.to(velocity.device)
            zero_where(velocity, left)

    def note_sent(self, state, group_id, sizes):
        """Worker thread, right after group ``group_id``'s sparse call
        (``sizes``: its members' entries, in the group's order): which
        entries the call took from this rank, those whose residual is now
        exactly 0, for ``after`` to zero their velocities. The host path's
        marks and list come from the library in one pass over the residual
        (``Communicator.residual_zeros``); the device path's from its own."""
        self._sent = True
        rule = self.now
        if not rule:
            return  # past the window: the call is counted, its residual not read
        members = state._layout.groups[group_id]
        offsets = [0, *itertools.accumulate(sizes)]
        for i, at, size in zip(members, offsets, sizes):
            self._member_of[i] = (group_id, at, size)
        waited = rule == "waited"
        before = self._before(group_id, members, offsets, sizes) if waited else None
        device_group = state._device_groups.get(group_id)
        if device_group is not None:
            zero = device_group.residual == 0
            became = None if before is None else (zero & ~before.to(zero.device)).nonzero().squeeze(1)
        else:
            spare, listed = self._buffers.get(group_id, (None, None))
            if spare is None or spare is before:
                spare = torch.empty(offsets[-1], dtype=torch.bool)
            if listed is None:
                listed = torch.empty(max(1, offsets[-1] // 64), dtype=torch.int64)
            comm = state._reducer.comm
            count = comm.residual_zeros(group_id, before, spare, listed)
            if count > listed.numel():  # more than room: make room once, and ask again
                listed = torch.empty(min(offsets[-1], 2 * count), dtype=torch.int64)
                count = comm.residual_zeros(group_id, before, spare, listed)
            zero, became = spare, None if before is None else listed[:count]
            self._buffers[group_id] = (before if waited else zero, listed)  # the marks not current
        if waited:
            self._note("zero", group_id, self.zero)
            self.zero[group_id] = zero
            cuts = [0] * (len(sizes) + 1) if became is None else [0, *torch.searchsorted(
                became, torch.tensor(offsets[1:], dtype=torch.int64, device=became.device)).tolist()]
        for j, (i, at, size) in enumerate(zip(members, offsets, sizes)):
            if waited:
                # A copy: the list is the next call's buffer. Nothing waited
                # before the first sparse call (or after a dense step).
                self._left[i] = became[cuts[j] : cuts[j + 1]] - at if became is not None else torch.empty(0, dtype=torch.int64)
            else:
                self._left[i] = zero[at : at + size]

    def _before(self, group_id, members, offsets, sizes):
        """The group's marks after its latest sparse call, or None where
        nothing waited; a loaded checkpoint's masks of what was still
        waiting become them at the group's first call."""
        before = self.zero.get(group_id)
        if before is None and any(i in self.loaded for i in members):
            before = torch.ones(offsets[-1], dtype=torch.bool)
            for i, at, size in zip(members, offsets, sizes):
                waiting = self.loaded.pop(i, None)
                if waiting is not None and waiting.numel() == size:
                    before[at : at + size] = ~waiting.reshape(-1)
        return before

    # -- checkpoints -------------------------------------------------------

    def waiting(self, i):
        """Parameter ``i``'s entries still waiting after its latest sparse
        call (a CPU bool mask), or None where nothing waited."""
        if i in self.loaded:
            return self.loaded[i].clone()
        group_id, at, size = self._member_of.get(i, (None, 0, 0))
        zero = self.zero.get(group_id)
        return None if zero is None else (~zero[at : at + size]).cpu()

    def steps_state(self):
        """The steps with a sparse call so far, this one's included: what a
        resumed run's masking counts on from (``load_steps``)."""
        return self.sparse_steps + int(self._sent)

    def load_steps(self, sparse_steps):
        self.sparse_steps, self._sent = int(sparse_steps), False

    def load(self, waiting):
        """A checkpoint's masks of entries still waiting (index -> mask)."""
        self.loaded = waiting
        self.zero, self._member_of = {}, {}
