"""The settings a newcomer holds: OkTopkState() is the one line; four
settings at the top, the rest in named groups with their defaults, one
immutable oktopk.Settings checked in one place; the flat names of before
still work; checkpoints saved before the settings object load."""

import dataclasses
import inspect
import os
import pickle

import pytest
import torch

import oktopk
from oktopk import Adaptation, Choice, Momentum, OkTopkState, Settings, Warmup, Wire
from oktopk.settings import FLAT, GROUPS

HERE = os.path.dirname(os.path.abspath(__file__))
SAVED = os.path.join(HERE, "data", "saved_states_v1.pt")  # made by data/make_saved_states.py at the code before the engine


def test_at_most_five_settings_at_the_top():
    params = inspect.signature(OkTopkState).parameters
    top = [name for name, p in params.items() if p.kind != p.VAR_KEYWORD and name not in GROUPS]
    assert top == ["process_group", "density", "algorithm", "timeout"]
    assert [name for name in params if name in GROUPS] == list(GROUPS)
    assert all(params[name].default == kind() for name, kind in GROUPS.items())  # every group has its defaults


def test_the_one_line():
    state = OkTopkState()
    try:
        assert state.settings == Settings()
        assert repr(state) == "OkTopkState()"
    finally:
        state.close()


def test_a_group_and_its_flat_names_are_the_same_settings():
    pairs = [
        (dict(momentum=Momentum(masking="waited")), dict(momentum_masking="waited")),
        (dict(warmup=Warmup(iters=10, compression="quantized")), dict(warmup_iters=10, warmup_compression="quantized")),
        (dict(choice=Choice(sparse_margin=0.2, dense_compression="fp16")), dict(sparse_margin=0.2, dense_compression="fp16")),
        (dict(wire=Wire(value_dtype=torch.bfloat16, tau=8)), dict(value_dtype="bfloat16", tau=8)),
        (dict(adaptation=Adaptation(density_schedule=(0.25, 100, 1))), dict(density_schedule=(0.25, 100, 1))),
    ]
    for grouped, flat in pairs:
        a, b = OkTopkState(**grouped), OkTopkState(**flat)
        try:
            assert a.settings == b.settings
            for name, value in flat.items():
                assert getattr(a, name) == value, name  # read back by the flat name
        finally:
            a.close()
            b.close()


def test_every_flat_name_reads_back_its_default():
    state = OkTopkState(algorithm="oktopk")
    try:
        flat = Settings().flat()
        assert list(flat) == list(FLAT)
        for name in FLAT:
            if name not in ("sparse_margin", "recheck_every", "algorithm"):  # None with a named algorithm
                assert getattr(state, name) == flat[name], name
    finally:
        state.close()


def test_repr_names_only_what_differs():
    state = OkTopkState(density=0.05, momentum_correction=False, sparse_margin=0.2)
    try:
        assert repr(state) == "OkTopkState(density=0.05, choice=Choice(sparse_margin=0.2), momentum=Momentum(correction=False))"
    finally:
        state.close()


def test_settings_are_immutable():
    state = OkTopkState()
    try:
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.settings.density = 0.5
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.settings.momentum.masking = True
        with pytest.raises(AttributeError):
            state.density = 0.5
        assert state.density == 0.01
    finally:
        state.close()


def test_checked_in_one_place():
    # The object refuses what the state refuses, with the same message.
    for flat, grouped in [(dict(density=2.0), dict(density=2.0)),
                          (dict(warmup_iters=1), dict(warmup=Warmup(iters=1))),
                          (dict(momentum_masking="later"), dict(momentum=Momentum(masking="later"))),
                          (dict(dense_compression="int3"), dict(choice=Choice(dense_compression="int3")))]:
        with pytest.raises(ValueError) as by_state:
            OkTopkState(**flat)
        with pytest.raises(ValueError) as by_settings:
            Settings(**grouped)
        assert str(by_state.value) == str(by_settings.value)
    with pytest.raises(ValueError, match="momentum must be an oktopk.Momentum"):
        Settings(momentum={"masking": True})


def test_an_unknown_keyword_names_the_settings():
    with pytest.raises(TypeError, match="unexpected keyword argument 'densty'.*warmup_iters"):
        OkTopkState(densty=0.05)


def test_from_settings_shares_one_object():
    settings = Settings(density=0.05, momentum=Momentum(masking="waited"))
    state = OkTopkState.from_settings(settings)
    try:
        assert state.settings is settings
        assert state.momentum_masking == "waited"
    finally:
        state.close()


def test_the_dense_compressions_come_from_the_paths():
    from oktopk.paths import DENSE_COMPRESSIONS, PATHS

    assert set(DENSE_COMPRESSIONS) == {name for name, path in PATHS.items() if path.compresses_dense}
    with pytest.raises(ValueError, match="'bf16', 'fp16', 'quantized' or None"):
        Settings(choice=Choice(dense_compression="int3"))
    # The notice that names the path weighed under Adam reads it from the
    # path (the fault campaign found fp16 missing from a table of its own).
    from oktopk.optimizers import dense_notice

    for name in DENSE_COMPRESSIONS:
        assert PATHS[name].described in dense_notice("AdamW", compressed=name)


@pytest.mark.parametrize("case", ["oktopk", "choice-momentum"])
def test_a_checkpoint_saved_before_the_settings_object_loads(case):
    saved = torch.load(SAVED, weights_only=False)[case]
    state = OkTopkState(**saved["settings"])
    try:
        state.load_state_dict(saved["state_dict"])
        assert state.iter == 6
        # The same content, saved again: nothing was lost or reinterpreted
        # (the choice's record now has a row for every path, fp16's included).
        again = state.state_dict()
        for key in ("iter", "layout", "tensors", "residual_groups", "momentum", "path", "rank", "world_size"):
            assert repr(again[key]) == repr(saved["state_dict"][key]), key
    finally:
        state.close()
    unpickled = pickle.loads(saved["pickle"])
    # Saved when bf16 was the default dense_compression and masking was off
    # by default: the pickle keeps the settings its run had, not today's
    # defaults.
    as_saved = OkTopkState(**{"dense_compression": "bf16", "momentum_masking": False, **saved["settings"]})
    try:
        assert unpickled.settings == as_saved.settings
        assert unpickled.iter == 6
    finally:
        unpickled.close()
        as_saved.close()


def test_a_checkpoint_of_another_layout_names_both():
    from oktopk.checkpoint import VERSION
    from oktopk.settings import with_checksum

    saved = dict(torch.load(SAVED, weights_only=False)["oktopk"]["state_dict"])
    saved["version"] = VERSION + 1
    state = OkTopkState(density=0.05, algorithm="oktopk", tau=2, tau_prime=3, momentum_correction=False)
    try:
        with pytest.raises(ValueError, match=f"layout version {VERSION + 1}.*reads version {VERSION}"):
            state.load_state_dict(with_checksum(saved))
        assert state.iter == 0
    finally:
        state.close()


def test_public_names():
    for name in ("Settings", "Warmup", "Choice", "Momentum", "Wire", "Adaptation"):
        assert getattr(oktopk, name) is getattr(oktopk.settings, name)


def test_the_settings_tables_of_the_docs_state_each_default_as_the_code_has_it():
    # A default is written once, in oktopk/settings.py; docs/pytorch.md's
    # tables and docs/pytorch-details.md's grouped constructor repeat it for
    # the reader, so they are checked here (the 4-bit dense_compression
    # default once left "bf16" in both).
    import ast
    import pathlib
    import re

    from oktopk.settings import FLAT, default_of

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    seen = set()
    for names, values in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", (docs / "pytorch.md").read_text(), re.M):
        names = [n.strip().strip("`") for n in names.split(",")]
        if not set(names) <= set(FLAT):
            continue
        values = [ast.literal_eval(v.strip().strip("`")) for v in values.split(",")]
        assert len(values) == len(names), names
        for name, value in zip(names, values):
            assert value == default_of(name) and type(value) is type(default_of(name)), (name, value, default_of(name))
            seen.add(name)
    assert seen == set(FLAT), set(FLAT) - seen  # every setting has its row
    details = (docs / "pytorch-details.md").read_text()
    for group, call in re.findall(r"`(Warmup|Choice|Momentum|Wire|Adaptation|Faults)\(([^`]*)\)`", details):
        for name, value in re.findall(r"(\w+)=((?:\"[^\"]*\"|[^,]+))", call):
            flat = next(k for k, (g, f) in FLAT.items() if g == group.lower() and f == name)
            assert ast.literal_eval(value.strip()) == default_of(flat), (group, name, value)


def test_the_docs_state_the_choices_back_off_as_the_code_has_it():
    # The longest wait between re-probes is oktopk.choice.MAX_BACKOFF times
    # recheck_every; both docs say it in words and in steps.
    import pathlib

    from oktopk.choice import DEFAULT_RECHECK_EVERY, MAX_BACKOFF

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    for page in ("pytorch.md", "pytorch-details.md"):
        text = " ".join((docs / page).read_text().split())
        assert f"up to {MAX_BACKOFF} × `recheck_every`" in text, page
    assert f"({MAX_BACKOFF * DEFAULT_RECHECK_EVERY:,} steps)" in " ".join((docs / "pytorch-details.md").read_text().split())


def test_the_docs_state_the_clear_win_as_the_code_has_it():
    # A probe at most CLEAR_WIN of the timed warm-up step chooses at once,
    # with no native probe; both docs say the share.
    import pathlib

    from oktopk.choice import CLEAR_WIN

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    for page in ("pytorch.md", "pytorch-details.md"):
        text = " ".join((docs / page).read_text().split())
        assert f"at most {CLEAR_WIN:.0%} of the last warm-up step's time" in text, page


@pytest.mark.parametrize("other", [{"algorithm": "oktopk"}, {"algorithm": "auto"}, {"dense_compression": None}])
def test_sparse_false_needs_the_measured_choice_and_a_dense_path_to_measure(other):
    # sparse=False is the measured choice with dense_compression's path in
    # sparse's place: a named algorithm (which runs every step) or no dense
    # path would leave it nothing to mean, so each is refused by name.
    from oktopk import OkTopkState

    with pytest.raises(ValueError, match="sparse=False") as raised:
        OkTopkState(sparse=False, **other)
    assert next(iter(other)) in str(raised.value)


def test_the_ranks_agree_on_every_setting_but_those_that_change_no_collective():
    # A setting left out of the agreement is one ranks may hold apart
    # unnamed: a new one (sparse_after) was, until the fault campaign's
    # mismatch job found the ranks failing on the choice's state instead.
    from oktopk.settings import FLAT
    from oktopk.step import agreement_settings

    local = {
        "timeout": "how long this rank waits for a peer; no collective depends on it",
        "grads_as_bucket_views": "where this rank's .grad points; the values reduced are the same",
        "on_rank_loss": "what a loss does, agreed by the survivors' own protocol (oktopk.survivors)",
    }
    state = OkTopkState()
    try:
        assert set(agreement_settings(state)) >= set(FLAT) - set(local), set(FLAT) - set(local) - set(agreement_settings(state))
        assert not set(local) & set(agreement_settings(state))
    finally:
        state.close()
