"""DGC's momentum factor masking and local gradient clipping, settings of
the hook's momentum correction (OkTopkState's ``momentum_masking``, by
default "waited" masking over the first sparse steps, and
``local_clip_norm``, opt-in; oktopk.momentum), on real DDP ranks over
gloo."""

import pickle

import pytest
import torch

import dgc_workers
import workers
from oktopk import OkTopkState
from oktopk.settings import AUTO_MASKING_STEPS
from test_ddp import run


def test_off_leaves_the_default_path_bitwise_unchanged():
    # The default masking and clipping passed by name, or a clip norm no
    # gradient reaches, must change no bit of the corrected hook's run.
    results = run(dgc_workers.off_is_default, 2, 8)
    for r, res in results.items():
        assert res["sparse_iters"] == 6 and res["corrected"] > 0, res
        assert all(all(s) for s in res["same"]), f"rank {r}: {res['same']}"


@pytest.mark.parametrize("device_path", [None, True], ids=["host", "device_path"])
def test_masking_zeroes_the_velocity_of_every_entry_that_left_and_ranks_agree(device_path):
    # With clipping on too: the two rules together, and every rank ends
    # with the same parameters, bit for bit.
    results = run(dgc_workers.masking, 2, 10, 0.5, device_path)
    for r, res in results.items():
        assert res["stopped"] is None, res["stopped"]
        assert (res["device_groups"] > 0) == bool(device_path), res["device_groups"]
        dense = [c for c in res["checks"] if c["dense"]]
        assert dense[1]["velocities"] > 0 and dense[1]["all_zero"], f"rank {r}: a dense step left velocities: {dense}"
        sparse = [c for c in res["checks"] if not c["dense"]]
        assert len(sparse) == 8, sparse
        for c in sparse:
            assert c["given"] > 0 and c["sent"] > 0, f"rank {r}: nothing left at step {c['step']}: {c}"
            assert c["kept_nonzero"] > 0, f"rank {r}: every velocity zeroed at step {c['step']}: {c}"
            assert c["wrong"] == 0, f"rank {r}: step {c['step']}: {c['wrong']} velocity entries not masked as sent: {c}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"


@pytest.mark.parametrize("device_path", [None, True], ids=["host", "device_path"])
def test_waited_masking_zeroes_the_velocity_of_entries_that_left_after_waiting_only(device_path):
    results = run(dgc_workers.masking, 2, 10, None, device_path, "waited")
    for r, res in results.items():
        assert res["stopped"] is None, res["stopped"]
        dense = [c for c in res["checks"] if c["dense"]]
        assert dense[1]["velocities"] > 0 and not dense[1]["all_zero"] and dense[1]["wrong"] == 0, f"rank {r}: a dense step masked: {dense}"
        sparse = [c for c in res["checks"] if not c["dense"]]
        assert len(sparse) == 8, sparse
        # The first sparse call follows a dense step: nothing had waited.
        assert sparse[0]["sent"] > 0 and sparse[0]["masked"] == 0, f"rank {r}: {sparse[0]}"
        assert any(0 < c["masked"] < c["sent"] for c in sparse[1:]), f"rank {r}: never both kinds of sent entry: {sparse}"
        for c in sparse:
            assert c["wrong"] == 0, f"rank {r}: step {c['step']}: {c['wrong']} velocity entries not masked by the rule: {c}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"


@pytest.mark.parametrize("post_clip", [None, 0.05], ids=["unclipped", "clipped_after_backward"])
def test_masking_over_its_first_steps_then_none(post_clip):
    # ("waited", 3): the rule over the first 3 steps with a sparse call,
    # then no velocity masked. With a framework's clip after backward the
    # correction goes on (it follows the clip), and what masking zeroed
    # stays zero.
    results = run(dgc_workers.masking, 2, 10, None, None, ("waited", 3), post_clip)
    for r, res in results.items():
        assert res["stopped"] is None, res["stopped"]
        sparse = [c for c in res["checks"] if not c["dense"]]
        assert [c["rule"] for c in sparse] == ["waited"] * 3 + [False] * 5, sparse
        assert any(c["masked"] > 0 for c in sparse[:3]), f"rank {r}: nothing masked in the window: {sparse}"
        assert all(c["masked"] == 0 for c in sparse[3:]) and all(c["sent"] > 0 for c in sparse), sparse
        for c in sparse:
            assert c["wrong"] == 0, f"rank {r}: step {c['step']}: {c['wrong']} velocity entries not as the rule of the step: {c}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"


def test_the_default_masking_is_waited_over_its_first_steps_where_it_can_act():
    state = OkTopkState(algorithm="oktopk")
    try:
        assert state.momentum_masking == "auto"
        assert (state._momentum.mask.rule, state._momentum.mask.steps) == ("waited", AUTO_MASKING_STEPS)
    finally:
        state.close()
    # Where masking cannot act it yields, and asks nothing of the user.
    for kwargs in ({"value_dtype": "int8"}, {"value_dtype": "bfloat16"}):
        state = OkTopkState(algorithm="oktopk", **kwargs)
        try:
            assert state._momentum.masking is False, kwargs
        finally:
            state.close()
    state = OkTopkState(algorithm="oktopk", momentum_correction=False)
    try:
        assert state._momentum is None
    finally:
        state.close()


def test_waited_masking_at_density_one_is_dense_sgd_with_momentum_bitwise():
    results = run(dgc_workers.waited_density_one, 2, 8)
    for r, res in results.items():
        assert res["sparse_iters"] == 6 and res["corrected"] > 0 and res["velocity_nonzero"] > 0, res
        assert all(res["same"]), f"rank {r}: {res['same']}"


@pytest.mark.parametrize("rule", ["waited", ("waited", 6)], ids=repr)
def test_waited_masking_resumes_bitwise(tmp_path, rule):
    # ("waited", 6): saved after 4 of its 6 masked steps, the resumed run
    # masks 2 more and then none, as the uninterrupted one does.
    results = run(dgc_workers.waited_resume, 2, str(tmp_path), rule)
    for r, res in results.items():
        full, resumed = res["full"], res["resumed"]
        assert resumed["params"] == full["params"], f"rank {r}: the resumed run's parameters differ"
        assert all(resumed["steps"][s] == full["steps"][s] for s in range(6, 10)), (r, full["steps"], resumed["steps"])


def test_clipping_bounds_each_gradient_norm_by_clip_over_sqrt_p():
    clip = 0.05  # below the test model's gradient norms: it bites
    results = run(dgc_workers.clipping, 2, 8, clip)
    for r, res in results.items():
        assert res["stopped"] is None, res["stopped"]
        w = res["worst"]
        assert w["seen"] > 0 and w["bit"] > 0, f"rank {r}: the clip never bit: {w}"
        assert w["ratio"] <= 1.0 + 1e-5, f"rank {r}: a clipped norm above clip / sqrt(P): {w}"
        assert w["error"] <= 1e-5, f"rank {r}: not clip_grad_norm_'s scaling: {w}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"


def test_masking_at_density_one_is_sgd_without_momentum():
    results = run(dgc_workers.masked_density_one, 2, 8)
    for r, res in results.items():
        assert res["corrected"] == res["params"] and res["sparse_iters"] == 6, res
        assert res["worst"] <= 1e-5, f"rank {r}: {res}"


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"momentum_masking": 1}, "momentum_masking"),
        ({"momentum_masking": "yes"}, "momentum_masking"),
        ({"momentum_masking": None}, "momentum_masking"),
        ({"momentum_masking": True, "momentum_correction": False}, "momentum_masking"),
        ({"momentum_masking": True, "value_dtype": "float16"}, "momentum_masking"),
        ({"momentum_masking": True, "value_dtype": "bfloat16"}, "momentum_masking"),
        ({"momentum_masking": "waited", "value_dtype": "bfloat16"}, "momentum_masking"),
        ({"momentum_masking": "waited", "momentum_correction": False}, "momentum_masking"),
        ({"momentum_masking": "Waited"}, "momentum_masking"),
        ({"momentum_masking": "Auto"}, "momentum_masking"),
        ({"momentum_masking": ("waited", 0)}, "momentum_masking"),
        ({"momentum_masking": ("waited", 2.5)}, "momentum_masking"),
        ({"momentum_masking": (False, 10)}, "momentum_masking"),
        ({"momentum_masking": ("auto", 10)}, "momentum_masking"),
        ({"momentum_masking": ("waited", 10, 1)}, "momentum_masking"),
        ({"momentum_masking": ("waited", 10), "value_dtype": "int8"}, "momentum_masking"),
        ({"momentum_masking": ("waited", 10), "momentum_correction": False}, "momentum_masking"),
        ({"local_clip_norm": 0}, "local_clip_norm"),
        ({"local_clip_norm": -1.0}, "local_clip_norm"),
        ({"local_clip_norm": float("inf")}, "local_clip_norm"),
        ({"local_clip_norm": float("nan")}, "local_clip_norm"),
        ({"local_clip_norm": True}, "local_clip_norm"),
        ({"local_clip_norm": "1.0"}, "local_clip_norm"),
        ({"local_clip_norm": 1.0, "momentum_correction": False}, "local_clip_norm"),
    ],
    ids=repr,
)
def test_bad_values_raise_value_error_naming_the_setting(kwargs, name):
    for algorithm in (None, "oktopk"):
        with pytest.raises(ValueError, match=name):
            OkTopkState(algorithm=algorithm, **kwargs)


def test_settings_are_kept_named_and_pickled():
    state = OkTopkState(algorithm="oktopk", momentum_masking=True, local_clip_norm=2)
    try:
        assert state.momentum_masking is True and state.local_clip_norm == 2.0 and isinstance(state.local_clip_norm, float)
        assert "momentum=Momentum(masking=True, local_clip_norm=2.0)" in repr(state)
        assert "momentum_masking" not in repr(OkTopkState(algorithm="oktopk"))
        copy = pickle.loads(pickle.dumps(state))
        assert (copy.momentum_masking, copy.local_clip_norm) == (True, 2.0)
        assert (copy._momentum.masking, copy._momentum.clip_norm) == (True, 2.0)
        copy.close()
    finally:
        state.close()


@pytest.mark.parametrize("name,values", [("momentum_masking", (True, False)), ("momentum_masking", ("waited", True)), ("local_clip_norm", (1.0, None))], ids=repr)
def test_a_rule_on_one_rank_only_fails_every_rank_naming_it(name, values):
    # A rank that masks or clips and one that does not would train apart
    # silently: the ranks' agreement on the settings refuses it at step 0.
    results = run(workers.settings_mismatch, 2, name, values, timeout=120)
    for r in range(2):
        res = results[r]
        assert res["step"] == 0 and "settings differ across ranks" in res["error"], (r, res)
        assert f"{name}: rank 0 has {values[0]!r}, rank 1 has {values[1]!r}" in res["error"], (r, res)

