"""The text benchmark's model, data and schedule (examples/pytorch/charlm.py):
the held-out split, the learning-rate schedule and the model's shape."""

import math

import pytest
import torch

import charlm


def write_fortunes(folder, name, entries):
    (folder / name).write_bytes(b"\n%\n".join(entries) + b"\n%\n")


def test_every_tenth_fortune_is_held_out_and_the_rest_trained_on(tmp_path):
    first = [b"fortune %d" % i for i in range(14)]
    second = [b"quote %d\nsecond line" % i for i in range(9)]
    write_fortunes(tmp_path, "a", first)
    write_fortunes(tmp_path, "b", second)
    # Neither pictures nor the index and symlink files fortune ships count.
    write_fortunes(tmp_path, "art", [b"picture"])
    (tmp_path / "a.dat").write_bytes(b"\x00\x01index")
    (tmp_path / "a.u8").symlink_to(tmp_path / "a")
    train, held = charlm.fortunes_corpus(str(tmp_path))
    entries = [e + b"\n\n" for e in first + second]  # files in name order
    assert bytes(held.tolist()) == entries[9] + entries[19]
    assert bytes(train.tolist()) == b"".join(e for i, e in enumerate(entries) if i not in (9, 19))


def test_a_missing_collection_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="fortunes package"):
        charlm.fortunes_corpus(str(tmp_path / "nowhere"))


def test_learning_rate_warms_up_linearly_then_decays_to_a_tenth_by_cosine():
    peak, steps, warmup = 0.002, 400, 30
    assert charlm.lr_at(0, steps, peak, warmup) == pytest.approx(peak / warmup, rel=1e-12)
    assert charlm.lr_at(warmup - 1, steps, peak, warmup) == pytest.approx(peak, rel=1e-12)
    assert charlm.lr_at(warmup, steps, peak, warmup) == pytest.approx(peak, rel=1e-12)
    middle = warmup + (steps - warmup) // 2
    assert charlm.lr_at(middle, steps, peak, warmup) == pytest.approx(peak * 0.55, rel=1e-12)
    assert charlm.lr_at(steps, steps, peak, warmup) == pytest.approx(peak * 0.1, rel=1e-12)
    assert all(charlm.lr_at(s + 1, steps, peak, warmup) <= charlm.lr_at(s, steps, peak, warmup) for s in range(warmup, steps))


def test_the_model_predicts_every_next_byte_and_sees_no_later_ones():
    torch.manual_seed(0)
    model = charlm.CharTransformer(dim=48, layers=1, heads=6, seq=16).eval()
    assert sum(p.numel() for p in charlm.CharTransformer().parameters()) == 1_890_688
    ids = torch.randint(0, 256, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        out, out_changed = model(ids), model(changed)
    assert out.shape == (2, 16, 256)
    # Causal: the logits before position 10 do not depend on bytes from 10 on.
    assert torch.equal(out[:, :10], out_changed[:, :10])
    assert not torch.equal(out[:, 10:], out_changed[:, 10:])
    assert charlm.lm_loss(model, ids, ids).item() == pytest.approx(math.log(256), abs=1.0)
