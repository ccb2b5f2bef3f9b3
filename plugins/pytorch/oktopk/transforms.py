"""The orthonormal transforms the compressed exchanges work in.

``ChunkedDCT`` is DeMo's (Peng, Quesnelle, Kingma 2024): a momentum's
energy gathers in few DCT coefficients of each block, so a few
coefficients per block carry most of it. ``hadamard_rotate`` is THC's
(Li et al., NSDI 2024) randomized Hadamard rotation: it spreads a
block's outliers over all its entries, so that a block's largest
magnitude, which sets its quantization scale, is close to its typical
one.

Both are orthonormal, so error feedback can be kept on either side of
them: what a rank removes from its state in the transformed space is
exactly what it sent.
"""

import torch


def largest_divisor_at_most(n, limit):
    """The largest divisor of ``n`` that is at most ``limit`` (1 at least)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def dct_matrix(n, dtype=torch.float32):
    """The orthonormal DCT-II matrix of size n (rows are the basis
    vectors, so ``m @ x`` transforms x and ``m.T @ y`` inverts)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    m = torch.cos(torch.pi * (2 * i + 1) * k / (2 * n)) * (2 / n) ** 0.5
    m[0] /= 2**0.5
    return m.to(dtype)


class ChunkedDCT:
    """DeMo's transform of a flat vector holding tensors of ``shapes`` one
    after another: a matrix in blocks of r x c (each side the largest
    divisor at most ``chunk`` of its dimension; a tensor of more
    dimensions as the matrix of its first dimension by the rest), a
    vector in pieces of the largest divisor at most ``chunk``, each block
    transformed by the orthonormal DCT-II along both sides. Coefficients
    are laid out tensor after tensor, block after block, so that a
    block's coefficients are contiguous (:meth:`blocks`)."""

    def __init__(self, shapes, chunk=64):
        self.parts = []  # (offset, rows, cols, r, c)
        self.basis = {}
        at = 0
        for shape in shapes:
            shape = tuple(shape)
            rows = shape[0] if len(shape) > 1 else 1
            numel = 1
            for s in shape:
                numel *= s
            cols = numel // rows if rows else 0
            r = largest_divisor_at_most(rows, chunk) if rows > 1 else 1
            c = largest_divisor_at_most(cols, chunk) if cols else 1
            for size in (r, c):
                self.basis.setdefault(size, dct_matrix(size))
            self.parts.append((at, rows, cols, r, c))
            at += rows * cols
        self.numel = at

    def blocks(self):
        """(offset, number of blocks, block length) of every tensor's
        coefficients."""
        return [(at, (rows // r) * (cols // c), r * c) for at, rows, cols, r, c in self.parts if rows * cols]

    def to(self, device):
        self.basis = {k: v.to(device) for k, v in self.basis.items()}
        return self

    def apply(self, x, inverse=False):
        """The transform (or its inverse) of x (..., numel), a new tensor:
        each block Y = A X B^T (inverse X = A^T Y B), A and B the DCT
        matrices of its sides."""
        out = torch.empty_like(x)
        lead = x.shape[:-1]
        for at, rows, cols, r, c in self.parts:
            if rows * cols == 0:
                continue
            a, b = self.basis[r], self.basis[c]
            piece = x[..., at : at + rows * cols]
            if inverse:
                y = (a.T @ piece.reshape(*lead, rows // r, cols // c, r, c) @ b).transpose(-3, -2)
            else:
                y = a @ piece.reshape(*lead, rows // r, r, cols // c, c).transpose(-3, -2) @ b.T
            out[..., at : at + rows * cols] = y.reshape(*lead, rows * cols)
        return out


def hadamard_matrix(size, dtype=torch.float32):
    """The orthonormal Hadamard matrix of a power-of-two size (Sylvester's
    construction); symmetric, so it is its own inverse."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"oktopk: a Hadamard block must be a power of two, got {size}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / size**0.5).to(dtype)


def rotation_signs(n, seed, device="cpu"):
    """n signs (±1.0) drawn from ``seed``: the same on every rank that
    passes the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1).to(device)


def hadamard_rotate(x, signs, h, inverse=False):
    """x (..., m), m a multiple of h's size, rotated in blocks of h's size:
    each block times diag(signs) then h; the inverse applies h then the
    signs. A new tensor."""
    block = h.shape[0]
    lead = x.shape[:-1]
    if inverse:
        return (x.reshape(*lead, -1, block) @ h).reshape(*lead, -1) * signs
    return ((x * signs).reshape(*lead, -1, block) @ h).reshape(*lead, -1)
