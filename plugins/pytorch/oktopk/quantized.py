"""A blockwise-quantized allreduce with error feedback, over the process
group's own collectives: the dense path an Adam-family optimizer's
gradients take when it measures faster than float32 (``oktopk.choice``).

Top-k sends a coordinate's gradient in bursts, every ~1/density steps, and
Adam turns a burst into one ordinary step (``oktopk.optimizers``). Here
every coordinate gets its gradient every step, rounded to a few bits, and
the rounding error waits in a residual for the next step: no bursts, and
about an eighth of float32's bytes at 4 bits. ZeRO++ (qgZ) sends gradients
this way, quantized in blocks; this one keeps both roundings' errors.

One call, P ranks, a bucket of n values, ``bits`` bits in blocks of
``block`` values (n padded to a multiple of P · block):

1. Each rank adds its residual to the bucket and rounds every value to one
   of 2^bits - 1 levels spread evenly over [-s, s], s its block's largest
   magnitude (sent in bfloat16); the rounding error is its new residual.
2. Reduce-scatter, quantized (one all-to-all): rank j receives every rank's
   codes and scales of the j-th of P equal chunks and averages them.
3. Rank j adds its owner residual to that average and rounds it again in
   the same way; that error is its new owner residual.
4. Allgather, quantized: every rank decodes the same P chunks, so the
   result is bitwise the same on every rank.

Each rank sends 2 (P - 1)/P · n · (bits + 16/block)/8 bytes, against
2 (P - 1)/P · n · 4 for a float32 ring allreduce: 0.141 of it at 4 bits in
blocks of 32. Nothing is lost: over the steps, the results plus the mean
of the ranks' residuals plus the owner residuals (one chunk per rank) sum
to the mean of the gradients. A value that is NaN or Inf on any rank
makes the call return NaN on every rank with every residual unchanged, as
the library's sparse calls do: AMP's scaler skips the step alike.

Where the work happens: on the CPU, with the default levels (no clip, no
rotation), each rounding and each decoding is one pass in the library
(``oktopk_quantize_blocks``, ``oktopk_dequantize_blocks``), the same
arithmetic as the tensor operations below, so the same bits; as tensor
operations a rounding is about ten passes over the bucket, paid on the
cores backward runs on. On a GPU, and for the other settings, the tensor
operations do it.
"""

import ctypes
import threading

import torch
import torch.distributed as dist

from . import _lib
from .peer_errors import peer_failures_named
from .transforms import hadamard_matrix, hadamard_rotate, rotation_signs

BITS = 4  # bits per value
BLOCK = 32  # values per bfloat16 scale (64 sent 6% fewer bytes and lost more on the BERT-style example: results/text.md)
LEVELS = "sym"  # "sym": 2^bits - 1 levels, zero among them; "full": 2^bits levels, every code used
CLIP = None  # None: a block's scale is its largest magnitude; c: at most c times its root mean square
ROTATE = False  # a randomized Hadamard rotation of every block first (THC)
ROTATION_SEED = 0x0C7A  # the rotation's signs, the same on every rank


def _levels(bits):
    return 2 ** (bits - 1) - 1  # "sym" codes stand for -levels .. levels


def quantize(x, bits=BITS, block=BLOCK, levels=LEVELS, clip=CLIP):
    """``x`` (1-D float32, a multiple of ``block`` long) as unsigned codes
    (uint8, below 2^bits) rounded to the nearest level, and a bfloat16
    scale per block: the block's largest magnitude, or with ``clip`` at
    most ``clip`` times its root mean square (larger values are clamped to
    it; error feedback keeps the rest). ``levels`` "sym": 2^bits - 1
    levels spread evenly over [-scale, scale], zero among them; "full":
    2^bits levels from -scale to scale, no zero. :func:`dequantize` gives
    what the codes stand for."""
    codes, scales, _ = _round(x, bits, block, levels, clip)
    return codes, scales


def _round(x, bits, block, levels, clip, out=None):
    """:func:`quantize`'s codes and scales, and what the codes stand for
    (:func:`dequantize`'s values, the same bits), in as few passes over
    ``x`` as the arithmetic allows: the gradient-sized passes are what a
    call costs on the CPU. ``out``: (float32, uint8) buffers of x's length
    to write the values and codes into (a fresh CPU buffer of a gradient's
    size costs more in page faults than the arithmetic done in it)."""
    xb = x.view(-1, block)
    scales = torch.maximum(xb.amax(1), xb.amin(1).neg_())  # the largest magnitude, without an abs() copy (aminmax over rows of a block is slower than both)
    if clip is not None:
        scales = torch.minimum(scales, clip * xb.square().mean(1).sqrt())
    scales = scales.to(torch.bfloat16)
    scale = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    values, codes = out if out is not None else (torch.empty_like(x), torch.empty(x.numel(), dtype=torch.uint8, device=x.device))
    level = values.view(-1, block)
    if levels == "full":
        top = 2**bits - 1
        torch.div(xb, scale, out=level).clamp_(-1, 1).add_(1).mul_(top / 2).round_()
        codes.copy_(values)
        return codes, scales, level.mul_(2 / top).sub_(1).mul_(scale).view(-1)
    half = _levels(bits)
    step = scale / half
    torch.div(xb, step, out=level).round_().clamp_(-half, half)
    # Codes are level + half: the levels (-half .. half) as int8, exactly,
    # then shifted in uint8 arithmetic (one byte a value, not four).
    codes.view(torch.int8).copy_(values)
    codes.add_(half)
    return codes, scales, level.mul_(step).view(-1)


def dequantize(codes, scales, bits=BITS, block=BLOCK, levels=LEVELS):
    return _dequantize(codes, scales, bits, block, levels, torch.empty(codes.numel(), device=codes.device))


def _dequantize(codes, scales, bits, block, levels, out):
    """What uint8 ``codes`` stand for, written into ``out`` (float32, as
    long); ``codes`` is left as it was. The same arithmetic, so the same
    bits, as the values :func:`_round` gives the sender."""
    scale = scales.reshape(-1).float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    c = out.view(-1, block)
    if levels == "full":
        top = 2**bits - 1
        out.copy_(codes)
        return c.mul_(2 / top).sub_(1).mul_(scale).view(-1)
    half = _levels(bits)
    # code - half in uint8 arithmetic wraps the negative levels to what
    # int8 reads as them: the level, exactly, for one byte-wide pass.
    codes.sub_(half)
    out.copy_(codes.view(torch.int8))
    codes.add_(half)
    return c.mul_(scale / half).view(-1)


def pack(codes, bits=BITS, out=None):
    """uint8 codes below 2^bits (a multiple of 8 long) as ``bits`` bits
    each: 8 codes in ``bits`` bytes (written into ``out``, of that many
    bytes in any shape, when given)."""
    u = codes
    if 8 % bits == 0:  # whole codes per byte: byte-wide arithmetic
        per_byte = 8 // bits
        u = u.view(-1, per_byte)
        if out is None:
            out = torch.empty(u.shape[0], dtype=torch.uint8, device=codes.device)
        out.copy_(u[:, 0].view(out.shape))
        for i in range(1, per_byte):  # codes are below 2^bits: adding is or-ing, and no byte overflows
            out.add_(u[:, i].view(out.shape), alpha=1 << (bits * i))
        return out
    word = (u.view(-1, 8).to(torch.int64) << (torch.arange(8, device=codes.device) * bits)).sum(1)
    packed = torch.stack([(word >> (8 * i)) & 0xFF for i in range(bits)], 1).to(torch.uint8).view(-1)
    return packed if out is None else out.copy_(packed.view(out.shape))


def unpack(packed, bits=BITS, out=None):
    """:func:`pack`'s codes back, from ``packed`` in any shape (into
    ``out``, uint8, 1-D, when given)."""
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per_byte = 8 // bits
        if out is None:
            out = torch.empty(packed.numel() * per_byte, dtype=torch.uint8, device=packed.device)
        u = out.view(-1, per_byte)
        for i in range(per_byte):
            torch.bitwise_right_shift(packed, bits * i, out=u[:, i].view(packed.shape))
        return out.bitwise_and_(mask)
    b = packed.reshape(-1, bits).to(torch.int64)
    word = (b << (torch.arange(bits, device=packed.device) * 8)).sum(1)
    codes = ((word[:, None] >> (torch.arange(8, device=packed.device) * bits)) & mask).to(torch.uint8).view(-1)
    return codes if out is None else out.copy_(codes)


def _library_rounds(device, bits, block, levels, clip, rotate):
    """Whether the library's one-pass rounding (capi/quantize.c) does a
    group's work: on the CPU, for the levels and settings it implements."""
    return (device.type == "cpu" and levels == "sym" and clip is None and not rotate and bits in (2, 4, 8)
            and block % 8 == 0 and block <= 4096)


def _round_in_library(x, residual, bits, block, codes, scales, new_residual):
    """``oktopk_quantize_blocks`` over the contiguous float32 ``x`` (plus
    ``residual`` unless None): packed codes into ``codes``, bfloat16 scales
    (as bytes) into ``scales``, the rounding's error into ``new_residual``.
    Returns whether a value was NaN or Inf."""
    flag = ctypes.c_int(0)
    code = _lib.lib().oktopk_quantize_blocks(x.data_ptr(), None if residual is None else residual.data_ptr(), x.numel(), bits,
                                             block, codes.data_ptr(), scales.data_ptr(), new_residual.data_ptr(),
                                             ctypes.byref(flag))
    if code != _lib.SUCCESS:
        raise _lib.OkTopkError(code, f"oktopk: the library refused to round {x.numel()} values at {bits} bits in blocks of {block}")
    return bool(flag.value)


def _decode_in_library(codes, scales, bits, block, out):
    """``oktopk_dequantize_blocks``: what packed ``codes`` and bfloat16
    ``scales`` stand for, into the contiguous float32 ``out``."""
    code = _lib.lib().oktopk_dequantize_blocks(codes.data_ptr(), scales.data_ptr(), out.numel(), bits, block, out.data_ptr())
    if code != _lib.SUCCESS:
        raise _lib.OkTopkError(code, f"oktopk: the library refused to decode {out.numel()} values at {bits} bits in blocks of {block}")


def _flag(frames, flag):
    """Every row's flag (the frame's last bfloat16): 1 where the sender
    saw a NaN or Inf."""
    frames[:, -2:] = torch.full((frames.shape[0], 1), flag, dtype=torch.bfloat16, device=frames.device).view(torch.uint8)


class _Scratch(threading.local):
    """Buffers a call works in on the CPU, kept from call to call (and
    shared by the groups a thread reduces one after another), sized to the
    largest call so far. Why: a fresh CPU buffer of a gradient's size is a
    fresh mapping, and its page faults cost more than the arithmetic done
    in it (on a 2-core machine, writing 68 MB into fresh memory took 88 ms,
    into a kept buffer 18). On a GPU torch's caching allocator already
    reuses freed blocks, and a fresh buffer leaves that memory to the
    activations between calls."""

    def __init__(self):
        self.buffers = {}

    def get(self, name, numel, dtype, device):
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self.buffers[name] = torch.empty(numel, dtype=dtype)
        return buffer[:numel]


_SCRATCH = _Scratch()


class QuantizedGroup:
    """One group of parameters' residuals (a DDP bucket's): this rank's
    (the bucket's padded length, its parameters in ``members`` order, of
    ``sizes`` values each) and its owner residual (its chunk; in the
    rotated space when ``rotate``). On the CPU each is one of a pair of
    buffers that alternate from call to call (:meth:`_spare`)."""

    def __init__(self, members, sizes, world, rank, device, bits=BITS, block=BLOCK, levels=LEVELS, clip=CLIP, rotate=ROTATE):
        if levels not in ("sym", "full"):
            raise ValueError(f"oktopk: quantization levels must be 'sym' or 'full', got {levels!r}")
        self.members, self.sizes, self.rank = tuple(members), tuple(sizes), rank
        n = sum(self.sizes)
        self.n, self.world, self.bits, self.block = n, world, bits, block
        self.levels, self.clip, self.rotate = levels, clip, bool(rotate)
        unit = world * block
        self.padded = -(-n // unit) * unit
        self.chunk = self.padded // world
        self.residual = torch.zeros(self.padded, device=device)
        self.owner_residual = torch.zeros(self.chunk, device=device)
        self._buffers = {}  # residual name -> (the one held, its spare): see _spare
        self._rotation = None  # (signs, Hadamard matrix), made when first used

    def _turn(self, x, inverse=False, at=0):
        """x (a whole number of blocks, starting at ``at`` of the padded
        vector) rotated, or turned back; x itself without a rotation."""
        if not self.rotate:
            return x
        if self._rotation is None or self._rotation[0].device != x.device:
            self._rotation = (rotation_signs(self.padded, ROTATION_SEED, x.device), hadamard_matrix(self.block).to(x.device))
        signs, h = self._rotation
        return hadamard_rotate(x, signs[at : at + x.numel()], h, inverse)

    def _quantize(self, x, out):
        """(codes, scales, what they stand for, whether ``x`` held a NaN or
        Inf), the codes and values in ``out`` (:func:`_round`): such a
        value makes its block's scale non-finite, so the scales tell
        without a pass of their own; ``x`` is then rounded with those
        values replaced (``nan_to_num``), and the caller sends the flag."""
        codes, scales, values = _round(x, self.bits, self.block, self.levels, self.clip, out)
        if bool(torch.isfinite(scales).all()):
            return codes, scales, values, False
        codes, scales, values = _round(torch.nan_to_num(x), self.bits, self.block, self.levels, self.clip, out)
        return codes, scales, values, True

    def _frame_layout(self):
        """(bytes of codes, bytes of scales) at the start of a chunk's frame."""
        return self.chunk * self.bits // 8, 2 * (self.chunk // self.block)

    def frame_bytes(self):
        """Bytes of one chunk's frame: codes, scales (bfloat16), and a flag
        (one bfloat16: 1 where the sender saw a non-finite value)."""
        return sum(self._frame_layout()) + 2

    def _frames(self, codes, scales, flag, out):
        """One frame per chunk of ``codes`` (whole chunks), as the uint8
        rows of ``out``."""
        rows = codes.numel() // self.chunk
        frames = out.view(rows, -1)
        code_bytes, scale_bytes = self._frame_layout()
        pack(codes, self.bits, frames[:, :code_bytes])
        frames[:, code_bytes : code_bytes + scale_bytes] = scales.view(rows, -1).view(torch.uint8)
        _flag(frames, flag)
        return frames

    def _encode(self, x, residual, out, frames, turn, scratch):
        """Rounds ``x`` plus ``residual`` (``x`` alone when None; an ``x``
        shorter than ``out`` is padded with zeros) into the rows of
        ``frames``, a chunk a row, their flags left to the caller, and
        writes what the rounding left off into ``out`` (the new residual;
        it may be ``x``). ``turn``: rotate first (step 1's space; the
        owner's chunk is rotated already). ``scratch``: the names'
        suffix of the tensor version's buffers. Returns whether a value
        was NaN or Inf."""
        n = x.numel()
        if _library_rounds(x.device, self.bits, self.block, self.levels, self.clip, self.rotate):
            code_bytes, scale_bytes = self._frame_layout()
            bad = False
            for r in range(frames.shape[0]):
                lo, hi = r * self.chunk, (r + 1) * self.chunk
                codes, scales = frames[r, :code_bytes], frames[r, code_bytes : code_bytes + scale_bytes]
                if hi <= n:
                    held = None if residual is None else residual[lo:hi]
                    bad |= _round_in_library(x[lo:hi], held, self.bits, self.block, codes, scales, out[lo:hi])
                    continue
                # The chunk the padding starts in: summed here, rounded in place.
                part, m = out[lo:hi], max(n - lo, 0)
                torch.add(x[lo : lo + m], residual[lo : lo + m], out=part[:m])
                part[m:] = residual[lo + m : hi]
                bad |= _round_in_library(part, None, self.bits, self.block, codes, scales, part)
            return bad
        if residual is not None:
            torch.add(x, residual[:n], out=out[:n])
            out[n:] = residual[n:]
        elif out is not x:
            out.copy_(x)
        buffers = (_SCRATCH.get("values" + scratch, out.numel(), torch.float32, out.device),
                   _SCRATCH.get("codes" + scratch, out.numel(), torch.uint8, out.device))
        codes, scales, sent, bad = self._quantize(self._turn(out) if turn else out, buffers)
        out.sub_(self._turn(sent, inverse=True) if turn else sent)
        self._frames(codes, scales, 0.0, frames)
        return bad

    def _decode(self, frames, out):
        """Frames (rows) back to values, in ``out`` (float32: the rows'
        chunks in order, cut off at its length; in the rotated space when
        ``rotate``, which a caller turns back), and whether any row's
        sender flagged a non-finite value."""
        rows = frames.shape[0]
        code_bytes, scale_bytes = self._frame_layout()
        flagged = bool(frames[:, code_bytes + scale_bytes :].contiguous().view(torch.bfloat16).float().max() > 0)
        if _library_rounds(frames.device, self.bits, self.block, self.levels, self.clip, self.rotate):
            for r in range(rows):
                lo, hi = r * self.chunk, (r + 1) * self.chunk
                codes, scales = frames[r, :code_bytes], frames[r, code_bytes : code_bytes + scale_bytes]
                if hi <= out.numel():
                    _decode_in_library(codes, scales, self.bits, self.block, out[lo:hi])
                elif lo < out.numel():  # the chunk the padding starts in
                    whole = _SCRATCH.get("tail", self.chunk, torch.float32, frames.device)
                    _decode_in_library(codes, scales, self.bits, self.block, whole)
                    out[lo:] = whole[: out.numel() - lo]
            return flagged
        # The codes buffer the sender's codes were in: they are in the
        # frames by now.
        codes = unpack(frames[:, :code_bytes], self.bits, _SCRATCH.get("codes", rows * self.chunk, torch.uint8, frames.device))
        scales = frames[:, code_bytes : code_bytes + scale_bytes].contiguous().view(torch.bfloat16)
        values = _SCRATCH.get("decoded", rows * self.chunk, torch.float32, frames.device) if out.numel() < rows * self.chunk else out
        _dequantize(codes, scales, self.bits, self.block, self.levels, values)
        if values is not out:
            out.copy_(values[: out.numel()])
        return flagged

    def _spare(self, name):
        """A buffer for the new value of residual ``name``: on the CPU the
        one this group held before the last call (kept, so that a
        take-back may restore it until the next call), never the one held
        now; on a GPU a fresh one (see _Scratch)."""
        held = getattr(self, name)
        if held.device.type != "cpu":
            return torch.empty_like(held)
        spare = next((b for b in self._buffers.get(name, ()) if b is not held), None)
        if spare is None:
            spare = torch.empty_like(held)
        self._buffers[name] = (held, spare)
        return spare

    def allreduce_(self, flat, group):
        """The average of ``flat`` (1-D float32, n long) over the ranks, in
        place (steps 1-4 above). Returns (the bytes this rank sent: a frame
        to each other rank in each of the two exchanges, whether the call
        completed); a NaN or Inf on any rank makes ``flat`` NaN on every
        rank and leaves the residuals as they were (not completed). The
        residuals are replaced, never written over (on the CPU the new ones
        go in the buffers that held the residuals before the previous
        call), so a caller may keep the old ones to take this call back
        until the next."""
        device, world = flat.device, self.world
        frame_bytes = self.frame_bytes()
        send = _SCRATCH.get("send", world * frame_bytes, torch.uint8, device).view(world, -1)
        residual = self._spare("residual")  # this call's own: its new residual
        _flag(send, 1.0 if self._encode(flat, self.residual, residual, send, turn=True, scratch="") else 0.0)
        received = _SCRATCH.get("received", world * frame_bytes, torch.uint8, device).view(world, -1)
        dist.all_to_all_single(received, send, group=group)
        mine = _SCRATCH.get("values", self.padded, torch.float32, device)
        bad_here = self._decode(received, mine)
        # Summed in rank order, so every owner's arithmetic is the same.
        average = torch.sum(mine.view(world, -1), 0, out=self._spare("owner_residual")).div_(world).add_(self.owner_residual)
        frame = _SCRATCH.get("frame", frame_bytes, torch.uint8, device).view(1, -1)
        self._encode(average, None, average, frame, turn=False, scratch="2")  # average becomes the new owner residual
        _flag(frame, 1.0 if bad_here else 0.0)
        gathered = _SCRATCH.get("gathered", world * frame_bytes, torch.uint8, device).view(world, -1)
        with peer_failures_named("the 4-bit path's gather of the owners' chunks"):
            dist.all_gather(list(gathered.unbind(0)), frame[0], group=group)
        if self.rotate:
            chunks = _SCRATCH.get("values", self.padded, torch.float32, device)
            bad_anywhere = self._decode(gathered, chunks)
            flat.copy_(self._turn(chunks, inverse=True)[: self.n])
        else:
            bad_anywhere = self._decode(gathered, flat)
        if not bad_anywhere:
            self.residual, self.owner_residual = residual, average
        else:
            flat.fill_(float("nan"))  # every rank alike; residuals unchanged
        return 2 * (world - 1) * frame_bytes, not bad_anywhere

    def held(self):
        """What this rank holds for the group's n values: its residual, and
        over the chunk it owns the owner residual (turned back from the
        rotated space) times the world size (the average divides it). A
        native step that adds it to this rank's values loses nothing of
        either."""
        held = self.residual.clone()
        at = self.rank * self.chunk
        held[at : at + self.chunk] += self.world * self._turn(self.owner_residual, inverse=True, at=at)
        return held[: self.n]

    def to(self, device):
        self.residual, self.owner_residual = self.residual.to(device), self.owner_residual.to(device)
        return self

    def state_dict(self):
        return {"members": list(self.members), "sizes": list(self.sizes), "world": self.world, "rank": self.rank,
                "bits": self.bits, "block": self.block, "levels": self.levels, "clip": self.clip, "rotate": self.rotate,
                # Copies: the buffers are written again two calls on.
                "residual": self.residual.to("cpu", copy=True), "owner_residual": self.owner_residual.to("cpu", copy=True)}

    @classmethod
    def from_state_dict(cls, saved):
        group = cls(saved["members"], saved["sizes"], saved["world"], saved["rank"], "cpu", saved["bits"], saved["block"],
                    saved["levels"], saved["clip"], saved["rotate"])
        group.residual.copy_(saved["residual"])
        group.owner_residual.copy_(saved["owner_residual"])
        return group
