"""oktopk.optim: DeMo's exchange carried by Ok-Topk, over real gloo
process groups and the library's sockets."""

import re

import numpy as np
import pytest
import torch

import optim_workers
from oktopk.transforms import ChunkedDCT, hadamard_matrix, hadamard_rotate, rotation_signs
from test_ddp import run


@pytest.mark.parametrize("shapes", [[(256, 192), (192,)], [(48, 20), (48,), (5, 48), (5,)], [(13,), (7, 11, 3), (1, 64)]])
def test_the_chunked_dct_is_orthonormal_and_inverts(shapes):
    t = ChunkedDCT(shapes)
    x = torch.randn(3, t.numel, dtype=torch.float32)
    y = t.apply(x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)  # orthonormal: norms kept
    assert torch.allclose(t.apply(y, inverse=True), x, rtol=0, atol=1e-5 * float(x.abs().max()))
    if t.numel <= 4096:  # the transform's matrix is orthogonal, within float32 rounding
        basis = t.apply(torch.eye(t.numel))
        assert torch.allclose(basis @ basis.T, torch.eye(t.numel), atol=1e-5)
    assert sum(blocks * length for _, blocks, length in t.blocks()) == t.numel


@pytest.mark.parametrize("block", [1, 64, 128])
def test_the_hadamard_rotation_is_orthonormal_and_inverts(block):
    h = hadamard_matrix(block)
    assert torch.allclose(h @ h.T, torch.eye(block), atol=1e-6)
    signs = rotation_signs(4 * block, seed=3)
    assert torch.equal(signs, rotation_signs(4 * block, seed=3))  # the same on every rank
    assert set(signs.tolist()) <= {-1.0, 1.0}
    x = torch.randn(2, 4 * block)
    y = hadamard_rotate(x, signs, h)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(hadamard_rotate(y, signs, h, inverse=True), x, atol=1e-5)
    with pytest.raises(ValueError):
        hadamard_matrix(96)


@pytest.fixture(scope="module")
def demo_run():
    world, steps, nan_at = 3, 6, 3
    return world, steps, nan_at, run(optim_workers.demo_steps, world, steps, 32, nan_at)


def test_demo_ranks_stay_bitwise_identical_and_grads_stay_local(demo_run):
    world, steps, nan_at, results = demo_run
    for s in range(steps):
        for r in range(1, world):
            assert np.array_equal(results[r]["steps"][s]["after"], results[0]["steps"][s]["after"]), (s, r)
        if s != nan_at:
            assert all(results[r]["steps"][s]["grad_is_local"] for r in range(world)), s  # no gradient allreduce


def test_demo_momentum_loses_exactly_what_was_sent_and_the_update_is_its_sign(demo_run):
    world, steps, nan_at, results = demo_run
    lr, wd = results[0]["lr"], results[0]["wd"]
    n = results[0]["n"]
    t = ChunkedDCT([(48, 20), (48,), (5, 48), (5,)])
    for s in range(steps):
        if s == nan_at:
            continue
        sent_total = np.zeros(n)
        for r in range(world):
            st = results[r]["steps"][s]
            acc, after = st["acc"], st["momentum"]
            # Every coefficient either stayed whole or left whole.
            stayed, left = after == acc, after == 0
            assert np.all(stayed | left), (s, r)
            sent = acc - after
            assert np.count_nonzero(sent) <= results[r]["selected"]
            # Only a block's own top 32 can leave.
            for at, blocks, length in results[r]["blocks"]:
                for b in range(blocks):
                    piece = np.abs(acc[at + b * length : at + (b + 1) * length])
                    gone = sent[at + b * length : at + (b + 1) * length] != 0
                    if gone.any() and length > 32:
                        assert piece[gone].min() >= np.sort(piece)[-32], (s, r, at, b)
            sent_total += sent
        # What the ranks sent, together, is what every rank applied: the
        # update is the sign of its inverse transform.
        st = results[0]["steps"][s]
        step_taken = (st["before"] * (1 - lr * wd) - st["after"]) / lr
        direction = t.apply(torch.from_numpy(sent_total).float(), inverse=True).numpy()
        clear = np.abs(direction) > 1e-4 * np.abs(direction).max()
        assert np.allclose(step_taken[clear], np.sign(direction[clear]), atol=1e-3), s
        assert np.count_nonzero(sent_total) > 0


@pytest.fixture(scope="module")
def demo_run_int4():
    world, steps, nan_at = 3, 6, 3
    return world, steps, nan_at, run(optim_workers.demo_steps, world, steps, 32, nan_at, "int4")


def test_demo_with_4_bit_values_keeps_in_the_momentum_what_it_did_not_deliver(demo_run, demo_run_int4):
    # value_dtype="int4": the selected coefficients travel as 4-bit codes
    # with a scale per 32. The ranks stay bitwise identical; what the
    # ranks' momenta lost, summed, is what every rank applied (the update
    # is the sign of its inverse transform), so a coefficient's rounding
    # stayed in some momentum; a NaN step still changes nothing; and the
    # same steps cost fewer bytes than with float32 values.
    world, steps, nan_at, results = demo_run_int4
    lr, wd, n = results[0]["lr"], results[0]["wd"], results[0]["n"]
    t = ChunkedDCT([(48, 20), (48,), (5, 48), (5,)])
    for s in range(steps):
        for r in range(1, world):
            assert np.array_equal(results[r]["steps"][s]["after"], results[0]["steps"][s]["after"]), (s, r)
        st = results[0]["steps"][s]
        if s == nan_at:
            for r in range(world):
                rs = results[r]["steps"][s]
                assert np.array_equal(rs["before"], rs["after"]) and np.array_equal(rs["momentum"], rs["momentum_before"]), r
            continue
        sent_total = sum(results[r]["steps"][s]["acc"].astype(np.float64) - results[r]["steps"][s]["momentum"] for r in range(world))
        assert np.count_nonzero(sent_total) > 0
        step_taken = (st["before"] * (1 - lr * wd) - st["after"]) / lr
        direction = t.apply(torch.from_numpy(sent_total).float(), inverse=True).numpy()
        clear = np.abs(direction) > 1e-3 * np.abs(direction).max()
        assert np.allclose(step_taken[clear], np.sign(direction[clear]), atol=1e-3), s
        # Some coefficient was rounded: not everything left whole.
        acc, after = st["acc"], st["momentum"]
        assert not np.all((after == acc) | (after == 0)), s
    float32_bytes = demo_run[3][0]["bytes"]
    assert results[0]["bytes"] < float32_bytes, (results[0]["bytes"], float32_bytes)  # a small model: the frames' headers weigh


def test_demo_nan_on_one_rank_skips_the_step_everywhere_and_changes_nothing(demo_run):
    world, steps, nan_at, results = demo_run
    for r in range(world):
        st = results[r]["steps"][nan_at]
        assert results[r]["skipped"] == 1
        assert np.array_equal(st["before"], st["after"]) and np.array_equal(st["momentum"], st["momentum_before"]), r
        assert np.isfinite(results[r]["steps"][-1]["after"]).all()
        assert results[r]["bytes"] > 0


def test_demo_resumes_bitwise_from_a_checkpoint(tmp_path):
    results = run(optim_workers.demo_resume, 2, 8, 3, str(tmp_path / "ckpt"))
    for r in range(2):
        assert results[r]["resumed"] == results[r]["whole"], r
        assert results[r]["steps"] == 8
        # The tampered topk breaks the checksum (an edit of a field).
        assert "fails its checksum" in results[r]["refused"], results[r]["refused"]


def test_demo_a_setting_that_differs_across_ranks_fails_every_rank_quickly():
    results = run(optim_workers.demo_mismatch, 2)
    for r in range(2):
        res = results[r]
        assert res["error"] is not None and res["seconds"] <= 5, res
        # Named at the first step's agreement, before any exchange.
        assert "settings differ across ranks: topk: rank 0 has 32, rank 1 has 8" in res["error"], res
        assert res["unchanged"] and res["momentum_zero"], r


def test_demo_a_dead_peer_fails_the_step_within_its_timeout_and_changes_nothing():
    results = run(optim_workers.demo_dead_peer, 3, 5)
    for r in range(2):
        res = results[r]
        assert res["error"] is not None and res["error"].startswith("OkTopkError") and res["seconds"] < 5 + 5, res
        assert res["unchanged"] and res["momentum_unchanged"] and res["steps"] == 2, r


def test_demo_a_checkpoint_with_a_changed_field_or_byte_is_refused_at_load():
    import copy

    import oktopk.optim

    params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]
    saved = oktopk.optim.DeMo(params, lr=0.01).state_dict()
    oktopk.optim.DeMo(params, lr=0.01).load_state_dict(copy.deepcopy(saved))  # intact: accepted
    for key, value in (("steps", 3), ("skipped_steps", 1), ("library_state", b"\x01")):
        changed = copy.deepcopy(saved)
        changed["oktopk"][key] = value
        with pytest.raises(ValueError, match="DeMo checkpoint fails its checksum"):
            oktopk.optim.DeMo(params, lr=0.01).load_state_dict(changed)


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    world = 2
    return world, run(optim_workers.demo_held_to_its_settings, world, str(tmp_path_factory.mktemp("demo") / "ckpt"))


@pytest.mark.parametrize("event, named", [
    ("lr_from_the_start", "lr: rank 0 has [0.01], rank 1 has [0.02]"),
    ("lr_changed_mid_run", "lr: rank 0 has [0.01], rank 1 has [0.05]"),
    ("weight_decay_changed_mid_run", "weight_decay: rank 0 has [0.2], rank 1 has [0.1]"),
])
def test_demo_a_setting_changed_on_one_rank_at_any_step_is_named_on_every_rank_within_a_second(held_run, event, named):
    world, results = held_run
    for r in range(world):
        e = results[r]["events"][event]
        assert e["error"] is not None and e["error"].startswith("OkTopkError") and named in e["error"], (r, e)
        assert e["seconds"] < 1.0, (r, e)
        assert e["state_unchanged"] and e["params_unchanged"], (r, e)


@pytest.mark.parametrize("event, named", [
    ("another_ranks_checkpoint", "rank 0: oktopk: this DeMo checkpoint belongs to rank 1 of 2, and this process is rank 0 of 2"),
    ("corrupt_on_one_rank", "rank 1: oktopk: this DeMo checkpoint fails its checksum"),
])
def test_demo_a_load_refused_on_one_rank_is_named_on_every_rank_and_changes_nothing(held_run, event, named):
    world, results = held_run
    for r in range(world):
        e = results[r]["events"][event]
        assert e["error"] is not None and e["error"].startswith("ValueError") and named in e["error"], (r, e)
        assert "refused on 1 of 2 ranks" in e["error"], (r, e)
        assert e["seconds"] < 1.0, (r, e)
        # state_dict() byte for byte, the parameters bitwise.
        assert e["state_unchanged"] and e["params_unchanged"], (r, e)


def test_demo_goes_on_after_refusals_with_ranks_identical_and_a_frozen_parameter_untouched(held_run):
    world, results = held_run
    for r in range(world):
        assert results[r]["events"]["after"]["error"] is None, results[r]["events"]["after"]
        assert results[r]["steps"] == 5 and results[r]["frozen_unchanged"], r
        assert torch.equal(results[r]["params"], results[0]["params"]), r


def test_demo_first_step_honours_its_timeout_when_a_rank_never_arrives():
    timeout = 3
    results = run(optim_workers.demo_rank_stopped_before_the_first_step, 2, timeout)
    e = results[0]
    assert e["error"] is not None and e["error"].startswith("OkTopkError"), e
    assert "not every rank reached step 0's settings' agreement within 3 s" in e["error"], e
    assert timeout <= e["seconds"] < timeout + 2, e
    assert e["steps"] == 0


def test_demo_refuses_bad_settings_naming_each():
    import math

    import oktopk.optim

    params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]
    for kwargs, named in [
        (dict(lr=math.inf), "lr must be a finite number"), (dict(lr=-1.0), "lr must be"), (dict(lr=True), "lr must be"),
        (dict(lr=float("nan")), "lr must be"), (dict(weight_decay=math.inf), "weight_decay must be a finite number"),
        (dict(weight_decay=False), "weight_decay must be"), (dict(timeout=math.inf), "timeout must be"),
        (dict(timeout=True), "timeout must be"), (dict(timeout=0), "timeout must be"),
        (dict(chunk=10**6), "chunk must be an int in [1, 1024]"), (dict(chunk=True), "chunk must be"),
        (dict(topk=5000), "topk must be an int in [1, chunk * chunk] = [1, 4096]"), (dict(topk=True), "topk must be"),
        (dict(topk=2.0), "topk must be"), (dict(momentum_decay=1.0), "momentum_decay must be"),
        (dict(momentum_decay=True), "momentum_decay must be"), (dict(process_group="world"), "process_group must be None"),
        (dict(communicator="tcp://x"), "communicator must be None or a callable"),
        (dict(value_dtype="float64"), "value_dtype must be one of float32, float16, bfloat16, int8, int4"),
        (dict(value_dtype="int8", communicator=lambda density, timeout: None), "value_dtype int8 needs process_group or collectives"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            oktopk.optim.DeMo(params, **kwargs)
    groups = [{"params": params[:1], "lr": math.inf}, {"params": params[1:]}]
    with pytest.raises(ValueError, match=re.escape("param_groups[0]: lr must be a finite number")):
        oktopk.optim.DeMo(groups, lr=0.01)


def test_demo_warns_when_prime_dimensions_make_it_send_more_than_dense():
    import oktopk.optim

    with pytest.warns(UserWarning, match=r"the parameters shaped \(97, 89\) split into blocks"):
        oktopk.optim.DeMo([torch.nn.Parameter(torch.randn(97, 89))], lr=0.01)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        oktopk.optim.DeMo([torch.nn.Parameter(torch.randn(96, 128)), torch.nn.Parameter(torch.randn(7))], lr=0.01)


def test_demo_refuses_a_checkpoint_of_other_settings_by_name():
    import oktopk.optim

    params = [torch.nn.Parameter(torch.randn(64, 64))]
    saved = oktopk.optim.DeMo(params, lr=0.01, topk=32).state_dict()
    opt = oktopk.optim.DeMo(params, lr=0.01, topk=8)
    before = opt.state_dict()
    with pytest.raises(ValueError, match="the checkpoint's topk is 32, this optimizer's 8"):
        opt.load_state_dict(saved)
    assert opt.state_dict() == before
    opt = oktopk.optim.DeMo(params, lr=0.01, topk=32, value_dtype="int4")
    # The default format is int8 (a checkpoint from before it was, float32,
    # is refused the same way, saying what to pass).
    with pytest.raises(ValueError, match=r"the checkpoint's value_dtype is 'int8', this optimizer's 'int4' \(pass value_dtype='int8'"):
        opt.load_state_dict(saved)
