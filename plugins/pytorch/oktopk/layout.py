"""The DDP hook's bucket layout: which residual each gradient entry meets,
whatever buckets DDP makes.

Residuals live in the library under one tensor id per group of parameters.
Parameters are numbered as first seen (the first iteration's layout, the
same in every run of the same model), a group's id derives from its members,
and its residual is laid out in the order of its parameters in the bucket it
was learned from, which the layout records (and a checkpoint keeps); so
neither DDP's reordering inside a bucket nor a process restart changes which
residual a gradient entry meets. That order is the rebuilt bucket's own, so
a CPU bucket is reduced in place, with no copy: ascending canonical order,
which the hook kept before (and which checkpoints saved then still hold), is
the reverse of the order gradients become ready in a typical model, and made
every bucket a gather and scatter.

The groups are DDP's rebuilt buckets, recorded from the first iteration that
is not DDP's first in this process: in a run from the start that is
iteration 1, still in the warm-up (warmup_iters >= 2), so the layout is in
every checkpoint taken at or after the first sparse step; a run resumed from
a checkpoint taken before that learns it the same way. A DDP bucket whose
members are not one known group (the first iteration of a resumed run sees
DDP's initial layout again) goes to a pool instead; each group is reduced
once all its parameters have arrived, and a bucket's future completes once
all of its parameters are reduced. Hooks fire in the same order on every
rank, so every rank issues the same library calls in the same order.

Parameters DDP found unused: with find_unused_parameters=True, DDP zeroes an
unused parameter's slot in the bucket before the hook runs, and when no rank
used it, leaves its .grad untouched, discarding what the hook returns for it.
A residual the library sent for it would then be lost. So each rank holds
back the parameters it did not use at this step (the library keeps their
residual); where another rank used one, that rank's values still arrive and
DDP applies the average, as without oktopk. A post-accumulate-grad hook marks
a parameter used; it runs before DDP's own hook on the same gradient
accumulator, so before the bucket is reduced. Under no_sync() the marks
accumulate until the synchronised step, as DDP's own record of used
parameters does.
"""

import contextlib
import hashlib

import torch


def group_id_of(members):
    """The library tensor id of a group of parameters (canonical indices)."""
    key = ",".join(str(i) for i in sorted(members)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def on_stream(stream):
    """Run on the CUDA stream backward produced the bucket on (None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class _PendingBucket:
    """A DDP bucket waiting in the regrouping pool: its future completes
    once every parameter in it has been reduced with its group."""

    __slots__ = ["tensor", "future", "stream", "remaining"]

    def __init__(self, tensor, future, stream, remaining):
        self.tensor, self.future, self.stream, self.remaining = tensor, future, stream, remaining


class BucketLayout:
    """Canonical parameter numbers, the groups residuals are kept in, the
    regrouping pool of buckets that are not one group, and the marks of the
    parameters used since their bucket was last reduced."""

    def __init__(self):
        # id(parameter) -> canonical index.
        self.param_index = {}
        # Library tensor id -> the canonical indices of its parameters in
        # its residual's order, and each parameter's group.
        self.groups = {}
        self.group_of = {}
        # Regrouping pool (worker thread only): canonical index -> (pending
        # bucket, start, end, held) of a parameter waiting for the rest of
        # its group.
        self._pool = {}
        # Canonical index -> whether the parameter's gradient was accumulated
        # since its bucket was last reduced (None: not known, its hook was
        # registered since), and the hooks' handles.
        self._used = {}
        self._grad_hooks = []
        # Whether parameters get those hooks: not while the native path is
        # chosen with no residual left to fold (a Python hook per parameter
        # per backward is felt on a fast link), again from the next sparse
        # step; the indices that have one.
        self.watching = True
        self._hooked = set()

    def members(self, bucket):
        """Canonical index and (start, end) in the bucket buffer of each of
        the bucket's parameters, in bucket order."""
        at, members = 0, []
        for p in bucket.parameters():
            index = self.param_index.get(id(p))
            if index is None:
                index = self.param_index[id(p)] = len(self.param_index)
            if self.watching and index not in self._hooked:
                self._watch(p, index)
            members.append((index, at, at + p.numel()))
            at += p.numel()
        return members

    # -- parameters DDP found unused ------------------------------------------

    def _watch(self, p, index):
        self._used[index] = None
        self._hooked.add(index)
        if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(lambda _, i=index: self._used.__setitem__(i, True)))

    def take_unused(self, members, tensor):
        """Canonical indices of the bucket's parameters unused on this rank
        since its last reduction; resets the marks. A parameter without a
        mark yet counts as unused when its slot in tensor is all zeros
        (tensor None: only reset the marks)."""
        unused = set()
        for i, a, b in members:
            used = self._used.get(i)
            if used is None:
                used = tensor is None or bool(tensor[a:b].any())
            self._used[i] = False
            if not used:
                unused.add(i)
        return unused

    def remove_hooks(self):
        """Remove the post-accumulate-grad hooks; marks are unknown again."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        self._hooked = set()
        self._used = {i: None for i in self._used}

    def stop_watching(self):
        """No hooks until ``watching`` is set again (the next bucket of a
        sparse step then registers them; until they have marked a step, a
        zero slot counts as unused)."""
        self.watching = False
        self.remove_hooks()

    # -- groups --------------------------------------------------------------

    def add_group(self, group_id, members):
        self.groups[group_id] = members
        for i in members:
            self.group_of[i] = group_id

    @property
    def calls_undoable(self):
        """Whether a group's completed call must stay undoable until its step
        settles: with other groups in the step, another group's NaN can void
        it after the call (StepFolds); one group's step pays nothing."""
        return len(self.groups) != 1

    def learn_group(self, indices):
        """Record a rebuilt-layout bucket (canonical indices in bucket order)
        as a group, its residual laid out in that order, unless its
        parameters already belong to groups; returns its group id."""
        group_id = group_id_of(indices)
        if group_id not in self.groups and not any(i in self.group_of for i in indices):
            self.add_group(group_id, tuple(indices))
        return group_id

    def slices(self, group_id, members, unused):
        """(start, end, held) in the bucket of each of the group's
        parameters, in the group's layout, for a bucket that is exactly the
        group."""
        where = {i: (a, b) for i, a, b in members}
        return [where[i] + (i in unused,) for i in self.groups[group_id]]

    def place(self, bucket, tensor):
        """Where a bucket of a step after DDP's first stands, in one call:
        ``(members, unused, group_id, slices)``, its parameters' canonical
        indices and spans (:meth:`members`), those unused on this rank since
        its last reduction (:meth:`take_unused`: their marks reset), the
        group its parameters make (:meth:`learn_group`), and their
        (start, end, held) in that group's layout when the bucket is exactly
        one group, else None (a bucket of DDP's provisional layout, pooled)."""
        members = self.members(bucket)
        unused = self.take_unused(members, tensor)
        group_id = self.learn_group([i for i, _, _ in members])
        slices = self.slices(group_id, members, unused) if group_id in self.groups else None
        return members, unused, group_id, slices

    def state_dict(self):
        return {group_id: list(members) for group_id, members in self.groups.items()}

    def load_state_dict(self, layout):
        self.groups, self.group_of = {}, {}
        for group_id, members in layout.items():
            self.add_group(group_id, tuple(members))

    # -- the regrouping pool (worker thread) -----------------------------------
    #
    # The caller pools a bucket and gets the groups it completes; for each it
    # takes the pieces ((tensor, start, end, held), in the group's layout) and
    # the stream of the bucket holding its first, reduces them, and says it
    # is done, which completes the futures of buckets with nothing left
    # pooled; or it fails the pool.

    def pool_bucket(self, tensor, members, unused, fut, stream):
        """A DDP bucket that is not one group: pool its parameters; returns
        the groups (ids, ascending) it completes."""
        pending = _PendingBucket(tensor, fut, stream, {i for i, _, _ in members})
        for i, a, b in members:
            self._pool[i] = (pending, a, b, i in unused)
        touched = sorted({self.group_of[i] for i, _, _ in members if i in self.group_of})
        return [group_id for group_id in touched if all(i in self._pool for i in self.groups[group_id])]

    @property
    def pooling(self):
        """Whether parameters wait in the pool."""
        return bool(self._pool)

    def leftover_groups(self):
        """After an iteration's last bucket: parameters still pooled belong
        to no known group (the model changed since the checkpoint); each
        bucket's leftovers become a new group, returned."""
        leftovers = {}
        for i in sorted(self._pool):
            leftovers.setdefault(id(self._pool[i][0]), []).append(i)
        made = []
        for group in leftovers.values():
            group_id = group_id_of(group)
            self.add_group(group_id, tuple(group))
            made.append(group_id)
        return made

    def pooled(self, group_id):
        """A complete group's pieces and the stream to reduce them on."""
        entries = [self._pool[i] for i in self.groups[group_id]]
        return [(p.tensor, a, b, held) for p, a, b, held in entries], entries[0][0].stream

    def done(self, group_id):
        """The group was reduced: its parameters leave the pool, and a
        bucket with none left pooled completes its future."""
        for i in self.groups[group_id]:
            p = self._pool.pop(i)[0]
            p.remaining.discard(i)
            if not p.remaining:
                with on_stream(p.stream):
                    p.future.set_result(p.tensor)

    def reduce_pooled(self, tensor, members, unused, fut, is_last, reduce_group):
        """A bucket that is not one group, reduced here, in the caller's
        thread: pooled (:meth:`pool_bucket`), then every group it completes
        reduced by ``reduce_group(group_id, pieces)`` (``pieces``: (tensor,
        start, end, held) per parameter, in the group's order) and marked
        :meth:`done`; after the iteration's last bucket (``is_last``), what
        is still pooled belongs to no known group (the model changed) and
        becomes new groups, reduced too. An error fails every pooled
        bucket's future, ``fut`` included."""
        try:
            complete = self.pool_bucket(tensor, members, unused, fut, None)
            while complete:
                for group_id in complete:
                    reduce_group(group_id, self.pooled(group_id)[0])
                    self.done(group_id)
                complete = self.leftover_groups() if is_last and self.pooling else []
        except Exception as e:  # noqa: BLE001 - DDP raises it from the future
            self.fail(e)
            if not fut.done():
                fut.set_exception(e)

    def fail(self, error):
        """Every pooled bucket's future carries error to DDP; the pool
        empties."""
        waiting = {id(p): p for p, _, _, _ in self._pool.values()}
        self._pool.clear()
        for p in waiting.values():
            if not p.future.done():
                p.future.set_exception(error)
