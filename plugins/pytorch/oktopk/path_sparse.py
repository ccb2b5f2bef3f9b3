"""The sparse path: the library's sparse allreduce (Ok-Topk, or the
algorithm the settings name), with a residual (error feedback) per group of
parameters kept inside liboktopk, or on the device on the device path
(``oktopk.device``).

Its parts, in this file's order:

* the communicator, made at the first sparse step (:func:`start`), and what
  each sparse iteration's calls use (:func:`call_for`);
* the device path's bookkeeping, shared with the Horovod optimizer
  (:func:`device_path_wanted`, :func:`device_group`, :func:`device_call`,
  :func:`save_group`);
* the worker thread's functions: a bucket that is one group is reduced by
  itself, any other through the layout's regrouping pool (``oktopk.layout``);
* the folds: before a step of another path the residual joins the values
  (:func:`fold_group`), so the switch loses nothing;
* the path itself (:class:`Sparse`, ``oktopk.paths``): a DDP bucket queued
  on the worker thread (a future), an FSDP2 shard reduced in place, and
  the folds of a bucket and of a shard.
"""

import torch
import torch.distributed as dist

from . import device as device_path_
from ._lib import OkTopkError
from .peer_errors import peer_failures_named
from .layout import on_stream
from .paths import Path
from .schedule import density_at


def _submit_bucket(engine, bucket, tensor, step, placement):
    """DDP: the bucket's average as a future, reduced on the engine's
    worker thread in sparse iteration ``step`` (engine.iter when its buckets
    fired); ``placement``: where it stands (``BucketLayout.place``)."""
    members, unused, group_id, slices = placement
    start(engine)
    call = call_for(engine, step)
    if engine._reducer.adaptive is None:
        engine.last_density = engine.density if call[0] is None else call[0]
    if tensor.device.type == "cuda":
        # The worker copies on the stream backward produced the bucket on;
        # the future's CUDA events make DDP wait for the copy back.
        fut = torch.futures.Future(devices=[tensor.device])
        stream = torch.cuda.current_stream(tensor.device)
    else:
        fut, stream = torch.futures.Future(), None
    reducer = engine._reducer
    if slices is not None:
        reducer.submit(_reduce_bucket, engine, group_id, tensor, slices, fut, stream, call)
    else:
        engine._pooled_iter = step
        reducer.submit(_pool_bucket, engine, tensor, members, unused, fut, stream, call)
    if bucket.is_last():
        reducer.submit(flush_pool, engine, call)
        if reducer.adaptive is not None and call[1] is not None:
            reducer.submit(_adapt, engine, call[1])
    return fut


def _host(engine, shard):
    """The shard itself when the library can read it (a contiguous CPU
    tensor), else a host copy in the engine's reused staging memory (pinned
    for CUDA shards)."""
    if shard.device.type == "cpu" and shard.is_contiguous():
        return shard
    host = engine._reducer.staging_for(shard.numel(), shard.dtype, shard.device.type == "cuda")
    host.copy_(shard.reshape(-1))
    return host


# -- the communicator and each iteration's calls ----------------------------


def start(engine):
    """Make the communicator and its worker at the first sparse step, with
    the residuals a checkpoint loaded before."""
    if engine._reducer.comm is None:
        from .checkpoint import check_owner  # here: the checkpoint saves this module's groups

        check_owner(engine)
        algorithm = "auto" if engine.algorithm is None else engine.algorithm  # the measured choice's sparse path
        engine._reducer.start(engine._collectives.communicator(algorithm, engine.density, engine.tau, engine.tau_prime, engine.timeout,
                                                               value_dtype=engine.value_dtype,
                                                               stochastic_rounding=engine.stochastic_rounding))
        # After a lost rank (oktopk.continuing) the residuals come from the
        # larger group's communicator: regrouped, each kept whole.
        load = engine._reducer.comm.load_tensor_state_regrouped if engine._pending_regrouped else engine._reducer.comm.load_tensor_state
        for bucket_id, blob in engine._pending_state.items():
            load(bucket_id, blob)
        engine._pending_regrouped = False
        engine._library_groups = set(engine._pending_state)
        engine._pending_state = {}
        if engine._link is not None:
            engine._reducer.comm.set_link(engine._link)


def call_for(engine, step):
    """(density or None, ξ step or None) of sparse iteration ``step``
    (engine.iter when its buckets fired): the same on every rank."""
    s = step - engine.warmup_iters
    density = None if engine.density_schedule is None else density_at(engine.density_schedule, engine.density, s)
    measure = engine.measure_xi_every is not None and s % engine.measure_xi_every == 0
    return density, (step if measure else None)


# -- the device path's bookkeeping (the Horovod optimizer's too) -----------
#
# Explicit arguments rather than the engine: the Horovod optimizer keeps the
# same dictionaries under its own names, per bucket id.


def device_path_wanted(device_path, algorithm, measure_xi_every, adaptive, device, numel):
    """Whether a sparse call on a tensor of ``numel`` entries on ``device``
    takes the device path, under these settings (``device_path``: None,
    True or False, see OkTopkState; ``adaptive``: the reducer's control or
    None). It runs Ok-Topk and measures no ξ."""
    if device_path is False or (device_path is None and device.type != "cuda"):
        return False
    return algorithm in (None, "auto", "oktopk") and measure_xi_every is None and adaptive is None and numel <= device_path_.MAX_ELEMENTS


def takes_device_path(engine, tensor):
    """Whether a sparse call on ``tensor`` (a bucket) takes the device path
    (see OkTopkState's device_path)."""
    return device_path_wanted(engine.device_path, engine.algorithm, engine.measure_xi_every, engine._reducer.adaptive, tensor.device,
                              tensor.numel())


def device_group(groups, library_groups, comm, group_id, n, device):
    """The group's device-path state in ``groups`` (id -> DeviceGroup), made
    at its first call; a state the library holds with its residual (its id
    in ``library_groups``: loaded from a checkpoint) moves its residual to
    the device."""
    group = groups.get(group_id)
    if group is None:
        group = device_path_.DeviceGroup(n, device)
        if group_id in library_groups:
            group.load(comm, group_id, comm.save_tensor_state(group_id))
            library_groups.discard(group_id)
        groups[group_id] = group
    return group


def device_call(reducer, host_buffers, group_id, grad, group, hold=(), density=None, tau_prime=None):
    """One device-path call (oktopk.device.sparse_allreduce_) on the
    reducer's communicator, its copies and statistics counted; returns its
    statistics, None when the step was skipped (a NaN or Inf on some
    rank)."""
    stats, moved, pairs = device_path_.sparse_allreduce_(reducer.comm, group_id, grad, group, host_buffers, hold, density, tau_prime)
    reducer.count_host_device(moved, pairs)
    if stats is not None:
        reducer.record(group_id, stats)
    return stats


def save_group(comm, groups, group_id):
    """A group's state saved from the library, with its residual from the
    device when it takes the device path (its DeviceGroup in ``groups``);
    None for a group the library holds no state for yet: one that no
    sparse call has completed on (a dense algorithm's, or one whose first
    sparse step was skipped for a NaN) has no residual to save."""
    group = groups.get(group_id)
    if group is not None:
        return group.checkpoint(comm, group_id)
    try:
        return comm.save_tensor_state(group_id)
    except OkTopkError as e:
        if "has no state yet" in str(e):
            return None
        raise


def save_groups(comm, groups, group_ids):
    """save_group of each of group_ids that has a engine, by id."""
    saved = {group_id: save_group(comm, groups, group_id) for group_id in sorted(group_ids)}
    return {group_id: blob for group_id, blob in saved.items() if blob is not None}


def reduce_on_device(engine, group_id, pieces, hold, density):
    """Worker thread: _reduce_pieces on the device path (oktopk.device):
    the pieces gathered on their device when they are not one whole
    buffer, and written back. Returns the call's statistics (None: the
    step was skipped) and the group's DeviceGroup."""
    tensor = pieces[0][0]
    whole = len(pieces) == 1 and pieces[0][1:] == (0, tensor.numel()) and tensor.is_contiguous()
    grad = tensor if whole else torch.cat([t[a:b] for t, a, b in pieces])
    group = device_group(engine._device_groups, engine._library_groups, engine._reducer.comm, group_id, grad.numel(), grad.device)
    engine._residual_groups.add(group_id)  # a native step folds it in first
    stats = device_call(engine._reducer, engine._host_buffers, group_id, grad, group, hold, density)
    engine._folds.see(grad)
    if not whole:
        write_back(pieces, grad)
    return stats, group


# -- the worker thread -------------------------------------------------------


def _reduce_pieces(engine, group_id, pieces, call):
    """Worker thread: sparse allreduce of the concatenation of pieces
    ((tensor, start, end, held), in the group's layout), written back into
    them; the held ones (parameters unused on this rank) are held back in the
    library. A step the library skipped for a non-finite gradient comes back
    as NaN (see Reducer.sparse_allreduce_). call is (density or None, the
    step when ξ is measured or None)."""
    hold, at = [], 0
    for _, a, b, held in pieces:
        if held:
            if hold and hold[-1][1] == at:
                hold[-1] = (hold[-1][0], at + b - a)
            else:
                hold.append((at, at + b - a))
        at += b - a
    sizes = [b - a for _, a, b, _ in pieces]  # the members', in the group's order (momentum masking)
    pieces = [piece[:3] for piece in pieces]
    merged = [pieces[0]]
    for t, a, b in pieces[1:]:
        if t is merged[-1][0] and a == merged[-1][2]:
            merged[-1] = (t, merged[-1][1], b)  # adjacent in one buffer: one copy
        else:
            merged.append((t, a, b))
    pieces = merged
    tensor = pieces[0][0]
    n = sum(b - a for _, a, b in pieces)
    cuda = tensor.device.type == "cuda"
    density, xi_step = call
    masking = engine._momentum is not None and engine._momentum.masking
    had_residual = group_id in engine._residual_groups
    if takes_device_path(engine, tensor):
        made = group_id not in engine._device_groups and group_id not in engine._library_groups
        stats, group = reduce_on_device(engine, group_id, pieces, hold, density)
        took_call(engine, group_id, stats, had_residual, group, made)
        if masking:
            engine._momentum.mask.note_sent(engine, group_id, sizes)
        return
    if not cuda and len(pieces) == 1 and pieces[0][1:] == (0, tensor.numel()) and tensor.is_contiguous():
        host = tensor  # in place
    else:
        # The one copy that remains: the library reads host memory (a CUDA
        # bucket goes to pinned memory by DMA), in the group's layout (a
        # bucket DDP laid out otherwise, as in a resumed run's first step,
        # or a group spread over buckets, is gathered), into reused staging.
        host = engine._reducer.staging_for(n, tensor.dtype, cuda)
        at = 0
        for t, a, b in pieces:
            host[at : at + b - a].copy_(t[a:b])
            at += b - a
    engine._residual_groups.add(group_id)  # a native step folds it in first
    if cuda:
        engine._reducer.count_host_device(2 * host.numel() * host.element_size())
    tau_prime = None
    adaptive = engine._reducer.adaptive
    if adaptive is not None:  # this worker thread adapts them, between steps
        density, tau_prime = adaptive.density, adaptive.tau_prime
        engine.last_density, engine.last_tau_prime = density, tau_prime
    undoable = engine._layout.calls_undoable  # the library keeps a copy of the residual to take it back with
    stats = engine._reducer.sparse_allreduce_(group_id, host, hold, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                             sparse_only=engine._choice is not None, undoable=undoable)
    took_call(engine, group_id, stats, had_residual, undoable=undoable)
    if masking:
        engine._momentum.mask.note_sent(engine, group_id, sizes)
    engine._folds.see(host)  # a step that folds other buckets: a skipped sparse call skips it too
    if host is not tensor:
        write_back(pieces, host)


def took_call(engine, group_id, stats, had_residual, group=None, made=False, undoable=True):
    """Right after group ``group_id``'s call (``engine``: the DDP hook's,
    FSDP2's or Horovod's; ``stats`` None: skipped for a NaN or Inf on
    some rank, so on every rank): a skip makes the step void; a completed
    call is recorded with what takes it back should another group's NaN
    void the step (StepFolds.settle): the library's oktopk_tensor_undo_call,
    a device-path residual swapped back from its scratch buffer
    (oktopk.device), a group the call ``made`` forgotten. ``had_residual``:
    the group held one before (a native step folds it); ``undoable``: the
    call was made so (device-path calls are)."""
    folds = engine._folds
    if stats is None:
        folds.skipped()
        return
    if not undoable:
        return
    comm, residual_groups = engine._reducer.comm, engine._residual_groups

    def take_back():
        # A load since (its residuals, groups and library states are the
        # checkpoint's) leaves nothing to take back: the library's undo
        # finds a loaded engine, and the sets and groups here were replaced.
        if engine._reducer.comm is comm:
            comm.undo_call(group_id)
        if group is not None and engine._device_groups.get(group_id) is group:
            if made:
                del engine._device_groups[group_id]
            else:
                group.residual, group.scratch = group.scratch, group.residual
        if not had_residual and engine._residual_groups is residual_groups:
            residual_groups.discard(group_id)

    folds.took(take_back)


def write_back(pieces, flat):
    """flat's consecutive slices back into pieces ((tensor, start, end))."""
    at = 0
    for t, a, b in pieces:
        t[a:b].copy_(flat[at : at + b - a])
        at += b - a


def _reduce_group(engine, group_id, pieces, stream, call):
    """Worker thread: one group's pieces reduced on stream, in sparse
    iteration ``call``; first raises an adaptation's failure."""
    _raise_adapt_error(engine)
    with on_stream(stream):
        _reduce_pieces(engine, group_id, pieces, call)


def _reduce_bucket(engine, group_id, tensor, slices, fut, stream, call):
    # Worker thread: one DDP bucket that is exactly one group; slices are
    # (start, end, held).
    try:
        _reduce_group(engine, group_id, [(tensor, a, b, held) for a, b, held in slices], stream, call)
        with on_stream(stream):
            fut.set_result(tensor)
    except BaseException as e:  # noqa: BLE001 - the future carries it to DDP
        fut.set_exception(e)


def _pool_bucket(engine, tensor, members, unused, fut, stream, call):
    """Worker thread: a bucket that is not one group goes to the layout's
    pool; the groups it completes are reduced."""
    _reduce_pooled(engine, call, lambda: engine._layout.pool_bucket(tensor, members, unused, fut, stream))


def flush_pool(engine, call):
    """Worker thread, after a step's last bucket: what is still pooled
    becomes new groups, reduced."""
    if engine._layout.pooling:
        _reduce_pooled(engine, call, engine._layout.leftover_groups)


def _reduce_pooled(engine, call, ready):
    """Reduce the pooled groups ``ready()`` returns; a failure fails every
    pooled bucket's future (DDP raises it)."""
    layout = engine._layout
    try:
        for group_id in ready():
            pieces, stream = layout.pooled(group_id)
            _reduce_group(engine, group_id, pieces, stream, call)
            layout.done(group_id)
    except BaseException as e:  # noqa: BLE001 - every waiting future carries it to DDP
        layout.fail(e)


def _adapt(engine, step):
    """Worker thread, after the last call of sparse iteration ``step``,
    which measured ξ: adapt the density and τ′ of the steps that follow
    (their calls come after this in the worker's queue, on every rank). A
    failure is raised by the next bucket."""
    try:
        engine._reducer.adapt(step)
    except BaseException as e:  # noqa: BLE001 - the next bucket's future carries it to DDP
        engine._adapt_error = e


def _raise_adapt_error(engine):
    if engine._adapt_error is not None:
        e, engine._adapt_error = engine._adapt_error, None
        raise e


# -- the folds: before a native step, the residual joins the values ---------


def _fold_on_device(engine, group_id, group, tensor, slices):
    """fold for a device-path group: the same fold, where the residual
    is."""
    pieces = [(tensor, a, b) for a, b, _ in slices]
    grad = torch.cat([tensor[a:b] for a, b, _ in slices])
    hold, at = [], 0
    for a, b, held in slices:
        if held:
            hold.append((at, at + b - a))
        at += b - a
    residual = group.residual.clone()
    if device_path_.fold_(grad, group, hold):
        write_back(pieces, grad)

    def give_back():
        group.residual.copy_(residual)
        engine._residual_groups.add(group_id)

    engine._folds.took(give_back)
    if not hold:
        engine._residual_groups.discard(group_id)


def fold_group(engine, group_id, tensor, slices):
    """Before a dense allreduce of a bucket that is group ``group_id``
    (``slices``: (start, end, held) of its parameters in the group's order):
    move the group's residual into it (held slots keep theirs), so the
    switch from sparse loses nothing. Only groups a sparse step left a
    residual in are folded. A bucket laid out otherwise than the group's
    residual (a resumed run's first step), or on CUDA, is staged through
    host memory in the group's order for it, once per switch."""
    comm = engine._reducer.comm
    if comm is None or group_id not in engine._residual_groups:
        return
    group = engine._device_groups.get(group_id)
    if group is not None:
        _fold_on_device(engine, group_id, group, tensor, slices)
        return
    hold, at = [], 0
    for a, b, held in slices:
        if held:
            hold.append((at, at + b - a))
        at += b - a
    in_order = all(slices[j][0] == (slices[j - 1][1] if j else 0) for j in range(len(slices))) and at == tensor.numel()
    if in_order and tensor.device.type == "cpu" and tensor.is_contiguous():
        comm.fold_residual_(group_id, tensor, hold)
    else:
        host = torch.cat([tensor[a:b] for a, b, _ in slices]).to("cpu")
        comm.fold_residual_(group_id, host, hold)
        write_back([(tensor, a, b) for a, b, _ in slices], host)

    def give_back():
        comm.unfold_residual(group_id)
        engine._residual_groups.add(group_id)

    engine._folds.took(give_back)
    if not hold:
        engine._residual_groups.discard(group_id)


def _reduce_pooled_dense(engine, bucket, tensor, members, unused):
    """A dense step's bucket in DDP's provisional layout (a resumed run's
    first step) whose groups hold residuals: its parameters wait in the
    layout's pool until each of their groups is complete; each complete
    group is gathered in its own layout, its residual folded in, and
    allreduced as the uninterrupted run's bucket of that group was (the
    same values in the same order). The allreduces run here, in the hook,
    so every rank issues them in the same order, as the quantized path's."""
    group, world = engine.process_group, dist.get_world_size(engine.process_group)
    fut = torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()

    def reduce_group(group_id, pieces):
        flat = torch.cat([t[a:b] for t, a, b, _ in pieces])
        slices, at = [], 0
        for _, a, b, held in pieces:
            slices.append((at, at + b - a, held))
            at += b - a
        fold_group(engine, group_id, flat, slices)
        with peer_failures_named("the allreduce of the groups a sparse step keeps dense"):
            dist.all_reduce(flat, group=group)
        engine._folds.see(flat.div_(world))
        write_back([(t, a, b) for t, a, b, _ in pieces], flat)

    engine._layout.reduce_pooled(tensor, members, unused, fut, bucket.is_last(), reduce_group)
    return fut


class Sparse(Path):
    name = "sparse"
    keeps_residual = True

    def reduce(self, engine, bucket, tensor, step):
        """DDP: the bucket's average as a future, reduced on the engine's worker
        thread in sparse iteration ``step`` (engine.iter when its buckets
        fired)."""
        return _submit_bucket(engine, bucket, tensor, step, engine._layout.place(bucket, tensor))

    def reduce_shard(self, engine, group_id, shard, step):
        """FSDP2: the module's shard (group ``group_id``) replaced, in place, by
        its sparse average over the replicas, in sparse iteration ``step``. The
        call is made here, in the hook, not on the worker thread: FSDP2 waits
        for the shard before it goes on."""
        start(engine)
        density, xi_step = call = call_for(engine, step)
        tau_prime = None
        adaptive = engine._reducer.adaptive
        if adaptive is not None:
            if xi_step is not None:
                # Adapted when the next step begins: every call of this one
                # is done then, on every rank.
                engine._measured_step = xi_step
            density, tau_prime = adaptive.density, adaptive.tau_prime
            engine.last_density, engine.last_tau_prime = density, tau_prime
        else:
            engine.last_density = engine.density if call[0] is None else call[0]
        had_residual = group_id in engine._residual_groups
        if takes_device_path(engine, shard) and shard.is_contiguous():
            # The shard stays on its device; only pairs cross (oktopk.device).
            flat = shard.view(-1)
            made = group_id not in engine._device_groups and group_id not in engine._library_groups
            stats, group = reduce_on_device(engine, group_id, [(flat, 0, flat.numel())], (), density)
            took_call(engine, group_id, stats, had_residual, group, made)
            return
        host = _host(engine, shard)
        engine._residual_groups.add(group_id)
        undoable = engine._layout.calls_undoable
        stats = engine._reducer.sparse_allreduce_(group_id, host, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                                 sparse_only=engine._choice is not None, undoable=undoable)
        took_call(engine, group_id, stats, had_residual, undoable=undoable)
        if host is not shard:
            shard.copy_(host)

    def holds(self, engine):
        return bool(engine._residual_groups)

    def watches(self, engine):
        # Which parameters a rank left unused matters until the next
        # sparse step, residual or not (oktopk.layout).
        return engine._layout.watching or bool(engine._residual_groups)

    def fold(self, engine, bucket, tensor, step):
        """Before a step of another path: each residual a sparse step left
        in the bucket's group joins it (fold_group), so the switch loses
        nothing; a parameter unused on this rank keeps its own. A bucket in
        DDP's provisional layout (a resumed run's first step) whose groups
        hold residuals is reduced here, group by group (_reduce_pooled_dense),
        and its future returned."""
        layout = engine._layout
        if not layout.watching and not engine._residual_groups:
            return None
        members, unused, group_id, slices = layout.place(bucket, tensor)
        if slices is not None:
            fold_group(engine, group_id, tensor, slices)
            if bucket.is_last() and engine._pooled_iter == step:
                # Buckets of this step that went through the regrouping
                # pool complete their groups.
                engine._reducer.submit(flush_pool, engine, call_for(engine, step))
            return None
        if not any(layout.group_of.get(i) in engine._residual_groups for i, _, _ in members):
            return None  # not one group, but none of its groups holds a residual
        return _reduce_pooled_dense(engine, bucket, tensor, members, unused)

    def fold_shard(self, engine, group_id, shard):
        """:meth:`fold` for an FSDP2 shard (the whole group, nothing held):
        the residual a sparse step left joins the shard,
        so the switch loses nothing. Written for the shard rather than through
        fold_group: it folds in place where the shard allows (a device
        group's residual into a view of the shard; a CUDA shard staged through
        the reducer's pinned memory, not a fresh copy), and records a device
        fold only when it folded (a non-finite sum changes nothing, and the
        group keeps its residual)."""
        if engine._reducer.comm is None or group_id not in engine._residual_groups:
            return
        group = engine._device_groups.get(group_id)
        if group is not None:
            flat = shard.reshape(-1)
            residual = group.residual.clone()
            if device_path_.fold_(flat, group):
                engine._folds.took(lambda: (group.residual.copy_(residual), engine._residual_groups.add(group_id)))
                engine._residual_groups.discard(group_id)
                if flat.data_ptr() != shard.data_ptr():
                    shard.copy_(flat.view_as(shard))
            return
        host = _host(engine, shard)
        comm = engine._reducer.comm
        comm.fold_residual_(group_id, host)
        engine._folds.took(lambda: (comm.unfold_residual(group_id), engine._residual_groups.add(group_id)))
        if host is not shard:
            shard.copy_(host)
        engine._residual_groups.discard(group_id)


PATH = Sparse()
