"""oktopk.optim: DeMo's exchange carried by Ok-Topk, over real gloo
process groups and the library's sockets."""

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
        assert "topk" in results[r]["refused"]


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
