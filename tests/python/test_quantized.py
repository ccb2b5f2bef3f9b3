"""oktopk.quantized: the blockwise-quantized allreduce with error feedback
(an Adam-family optimizer's compressed dense path), over real gloo process
groups."""

import numpy as np
import pytest
import torch

import workers
from oktopk.quantized import BITS, BLOCK, _decode_in_library, _library_rounds, _round, _round_in_library, dequantize, pack, quantize, unpack
from test_ddp import run


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_pack_into_bits_and_round_to_the_nearest_level(bits):
    x = torch.randn(4096) * torch.logspace(-30, 3, 4096)  # blocks of every scale, subnormal ones included
    x[64:128] = 0.0  # a block of zeros
    codes, scales = quantize(x, bits, 64)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 4096 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)
    # Packed into, and read back from, the code columns of frame rows (a
    # strided view), as the allreduce builds its frames: the same bytes.
    frames = torch.full((4, 1024 * bits // 8 + 3), 0xAB, dtype=torch.uint8)
    pack(codes, bits, frames[:, :-3])
    assert torch.equal(frames[:, :-3].reshape(-1), packed) and bool((frames[:, -3:] == 0xAB).all())
    assert torch.equal(unpack(frames[:, :-3], bits, torch.empty(4096, dtype=torch.uint8)), codes)
    levels = 2 ** (bits - 1) - 1  # codes 0 .. 2 levels stand for -levels .. levels
    assert codes.dtype == torch.uint8 and int(codes.max()) == 2 * levels
    assert torch.equal(codes[64:128], torch.full((64,), levels, dtype=torch.uint8))
    # Each value is within half a level of what its code stands for, unless
    # its block's scale rounded below it in bfloat16 (then clamped to it).
    step = (scales.float() / levels).repeat_interleave(64)
    error = (dequantize(codes, scales, bits, 64) - x).abs()
    big = x.abs() <= scales.float().repeat_interleave(64)
    assert bool((error[big] <= 0.5 * step[big] * (1 + 1e-6) + 1e-45).all())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_full_levels_use_every_code_and_round_to_the_nearest(bits):
    x = torch.randn(4096)
    codes, scales = quantize(x, bits, 128, "full")
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    assert int(codes.min()) == 0 and int(codes.max()) == 2**bits - 1
    # Levels -s, ..., s, 2^bits of them: within half a level's spacing.
    spacing = (2 * scales.float() / (2**bits - 1)).repeat_interleave(128)
    big = x.abs() <= scales.float().repeat_interleave(128)
    error = (dequantize(codes, scales, bits, 128, "full") - x).abs()
    assert bool((error[big] <= 0.5 * spacing[big] * (1 + 1e-6)).all())


def test_a_clipped_scale_is_at_most_its_multiple_of_the_blocks_rms():
    x = torch.randn(1024)
    x[5] = 100.0  # an outlier, clamped
    _, scales = quantize(x, 3, 128, "full", clip=2.0)
    rms = x.view(-1, 128).square().mean(1).sqrt()
    assert bool((scales.float() <= 2.0 * rms * (1 + 2**-7)).all())  # bfloat16's rounding
    codes, _ = quantize(x, 3, 128, "full", clip=2.0)
    assert int(codes[5]) == 7  # the outlier sits at the top level


@pytest.mark.parametrize("bits,block", [(4, 32), (2, 8), (8, 64), (4, 16)])
def test_the_librarys_one_pass_rounding_gives_the_tensor_operations_bits(bits, block):
    """oktopk_quantize_blocks / oktopk_dequantize_blocks (the CPU's path)
    against the tensor version (a GPU's, and the other settings'): the same
    codes, scales, residual and decoded values, bit for bit, on blocks of
    every scale (subnormal ones and zeros included), values exactly half a
    level apart (ties round to even) and a scale that rounds below its
    block's largest value in bfloat16 (clamped)."""
    assert _library_rounds(torch.device("cpu"), bits, block, "sym", None, False)
    n = 64 * block
    gen = torch.Generator().manual_seed(bits * 1000 + block)
    x = torch.randn(n, generator=gen) * torch.logspace(-40, 4, n)
    residual = torch.randn(n, generator=gen) * torch.logspace(-42, 2, n)
    x[: 2 * block] = 0.0
    residual[: block] = 0.0  # a block of zeros: the smallest scale
    half = 2 ** (bits - 1) - 1
    ties = torch.arange(block, dtype=torch.float32) % (2 * half + 1) - half + 0.5  # level + 1/2: ties
    ties[0] = half  # the scale: ties sit half a step apart, exactly
    x[4 * block : 5 * block], residual[4 * block : 5 * block] = ties, 0.0
    x[6 * block] = 1.00390625 * 3  # 1 + 2^-8: the bfloat16 scale rounds to 3, below it
    acc = x + residual
    values, codes = torch.empty(n), torch.empty(n, dtype=torch.uint8)
    want_codes, want_scales, want_values = _round(acc, bits, block, "sym", None, (values, codes))
    packed, scales, new_residual = torch.empty(n * bits // 8, dtype=torch.uint8), torch.empty(n // block, dtype=torch.bfloat16), torch.empty(n)
    assert not _round_in_library(x, residual, bits, block, packed, scales.view(torch.uint8), new_residual)
    assert torch.equal(unpack(packed, bits), want_codes)
    assert torch.equal(scales, want_scales)
    assert torch.equal(new_residual, acc - want_values)
    decoded = torch.empty(n)
    _decode_in_library(packed, scales.view(torch.uint8), bits, block, decoded)
    assert torch.equal(decoded, dequantize(want_codes, want_scales, bits, block)) and torch.equal(decoded, want_values)
    # Rounded in place (the owner's step): the same, and a NaN is flagged.
    assert not _round_in_library(acc, None, bits, block, packed, scales.view(torch.uint8), acc)
    assert torch.equal(acc, new_residual) and torch.equal(unpack(packed, bits), want_codes)
    x[3 * block + 1] = float("nan")
    assert _round_in_library(x, residual, bits, block, packed, scales.view(torch.uint8), new_residual)


def test_the_library_refuses_what_it_cannot_round():
    packed, scales, out = torch.empty(64, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8), torch.empty(128)
    with pytest.raises(Exception, match="refused to round 120 values at 4 bits in blocks of 32"):
        _round_in_library(torch.zeros(120), None, 4, 32, packed, scales, out[:120])
    with pytest.raises(Exception, match="refused to decode 128 values at 3 bits"):
        _decode_in_library(packed, scales, 3, 32, out)
    assert not _library_rounds(torch.device("cpu"), 3, 32, "sym", None, False)  # 3 bits: the tensor version
    assert not _library_rounds(torch.device("cpu"), 4, 32, "sym", None, True)  # rotated: the tensor version
    assert not _library_rounds(torch.device("meta"), 4, 32, "sym", None, False)  # not on the CPU: the tensor version


def test_an_allreduce_through_the_library_equals_one_through_the_tensor_operations():
    """3 ranks, the defaults: every call's result, the residuals, a NaN's
    call and what the group holds, bitwise the same either way."""
    library = run(workers.quantized_calls, 3, None)
    tensors = run(workers.quantized_calls, 3, None, True)
    for rank in range(3):
        a, b = library[rank], tensors[rank]
        for call_a, call_b in zip(a["calls"], b["calls"]):
            assert np.array_equal(call_a[1], call_b[1]) and call_a[2:] == call_b[2:]
        for key in ("residual", "owner_residual", "held"):
            assert np.array_equal(a[key], b[key]), key
        assert np.isnan(a["nan_result"]).all() and np.isnan(b["nan_result"]).all()
        assert a["nan_completed"] is b["nan_completed"] is False and a["residuals_unchanged"] and b["residuals_unchanged"]


RECIPES = {"4-bit": None, "3-bit rotated": dict(bits=3, block=128, levels="full", clip=2.0, rotate=True)}


@pytest.fixture(scope="module", params=[(2, "4-bit"), (3, "4-bit"), (3, "3-bit rotated")], ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_run(request):
    world, recipe = request.param
    return world, RECIPES[recipe], run(workers.quantized_calls, world, RECIPES[recipe])


def owner_residuals_unrotated(results, world, recipe):
    """Every rank's owner residual, in the original space, concatenated."""
    owner = np.concatenate([results[r]["owner_residual"] for r in range(world)])
    if recipe and recipe.get("rotate"):
        from oktopk.quantized import ROTATION_SEED
        from oktopk.transforms import hadamard_matrix, hadamard_rotate, rotation_signs

        signs = rotation_signs(owner.size, ROTATION_SEED)
        owner = hadamard_rotate(torch.from_numpy(owner), signs, hadamard_matrix(recipe["block"]), inverse=True).numpy()
    return owner


def test_every_rank_gets_the_same_bits_and_the_bytes_are_about_an_eighth_of_float32s(quantized_run):
    world, recipe, results = quantized_run
    for step in range(6):
        outs = [results[r]["calls"][step][1] for r in range(world)]
        assert all(results[r]["calls"][step][3] for r in range(world)), step  # every finite call completed
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), step
        exact = sum(results[r]["calls"][step][0].astype(np.float64) for r in range(world)) / world
        assert not np.array_equal(outs[0], exact.astype(np.float32))  # rounded, not exact
        # And close: at 4 bits within a quarter of the largest magnitude; at 3
        # bits with a clipped scale the clamped values' excess waits in the
        # residuals, so a call alone is further off.
        assert np.abs(outs[0] - exact).max() <= (0.25 if recipe is None else 0.4) * np.abs(exact).max()
    bits, block = (recipe or {}).get("bits", BITS), (recipe or {}).get("block", BLOCK)
    padded, sent = results[0]["padded"], results[0]["calls"][0][2]
    assert sent == 2 * (world - 1) * (padded // world * bits // 8 + 2 * (padded // world // block) + 2)
    float32_ring = 2 * (world - 1) / world * padded * 4
    assert sent <= (bits + 16 / block + 0.3) / 32 * float32_ring  # the bits, a 16-bit scale per block, the flag


def test_nothing_is_lost_results_plus_residuals_sum_to_the_gradients(quantized_run):
    # Over the calls: sum of results + mean of the ranks' residuals + the
    # owner residuals (rank j holds chunk j) = sum of the mean inputs, to
    # float32 rounding.
    world, recipe, results = quantized_run
    chunk = results[0]["chunk"]
    total = sum(results[0]["calls"][s][1].astype(np.float64) for s in range(6))
    total += sum(results[r]["residual"][:1000].astype(np.float64) for r in range(world)) / world
    owner = owner_residuals_unrotated(results, world, recipe)[:1000]
    total += owner
    want = sum(results[r]["calls"][s][0].astype(np.float64) for r in range(world) for s in range(6)) / world
    assert np.abs(total - want).max() <= 1e-5 * np.abs(want).max()
    assert chunk * world == results[0]["padded"]


def test_a_nan_on_one_rank_is_nan_on_every_rank_and_moves_no_residual(quantized_run):
    world, _, results = quantized_run
    for r in range(world):
        assert np.isnan(results[r]["nan_result"]).all() and results[r]["residuals_unchanged"], r
        assert results[r]["nan_completed"] is False, r  # told, so the hook voids the step
        assert results[r]["saved_equal"], r


def test_a_call_leaves_the_residuals_it_replaced_and_a_saved_state_as_they_were(quantized_run):
    # The residuals before a call are what taking the call back restores
    # (the hook's void steps), and a state_dict is a copy: the buffers the
    # calls reuse must not be written under either.
    world, _, results = quantized_run
    for r in range(world):
        assert results[r]["replaced_kept"] == [True] * 6, r
        assert results[r]["state_dict_kept"], r


def test_what_a_group_holds_for_a_native_step_is_its_residual_and_its_owned_chunk(quantized_run):
    # A native step after quantized ones adds this to the rank's values:
    # its residual, and over the chunk it owns its owner residual times the
    # world size, so the average over the ranks keeps both.
    world, recipe, results = quantized_run
    chunk = results[0]["chunk"]
    owner = owner_residuals_unrotated(results, world, recipe)
    for r in range(world):
        res = results[r]
        want = res["residual"].astype(np.float64).copy()
        want[r * chunk : (r + 1) * chunk] += world * owner[r * chunk : (r + 1) * chunk]
        # float32 rounding of values up to a few units: a few ulps of the
        # largest (the rotation's sums round differently on other CPUs).
        scale = max(1.0, np.abs(want[:1000]).max())
        assert np.allclose(res["held"], want[:1000], rtol=0, atol=1e-6 * scale)


@pytest.fixture(scope="module", params=["quantized", None])
def resume_run(request, tmp_path_factory):
    return request.param, run(workers.quantized_resume, 2, str(tmp_path_factory.mktemp("resume")), request.param)


@pytest.mark.parametrize("first", [7, 16])
def test_a_run_resumed_under_adamw_continues_exactly(resume_run, first):
    # Resumed after step 7 or 16: the resumed run's first step meets DDP's
    # provisional bucket, which holds both rebuilt ones. Quantized: each
    # group is reduced from the layout's pool with its saved residuals.
    # float32 (dense_compression=None, native on every step): nothing is
    # held, so the bucket goes native as it is (it once went through the
    # sparse regrouping, a sparse step under AdamW). Either way the paths
    # and final parameters equal the whole run's, bitwise.
    compression, results = resume_run
    for r in range(2):
        full, resumed = results[r]["full"], results[r][first]
        want = {"quantized", "native"} if compression else {"native"}
        assert set(full["paths"].values()) - {"warm-up"} == want, full["paths"]
        assert resumed["paths"] == {s: full["paths"][s] for s in range(first, 20)}
        assert resumed["params"] == full["params"], f"rank {r}"
