"""The fp16 path: the process group's allreduce in float16, averaged, as
``fp16_compress_hook`` runs it: half the bytes, no residual; a compressed
dense path like bf16 (``dense_compression="fp16"``). float16 keeps 3 more
bits of mantissa than bfloat16 and 3 fewer of exponent: an average beyond
65504 in magnitude becomes Inf, which the step's NaN/Inf check then skips
(``torch.amp.GradScaler``'s loss scaling keeps gradients in range).

Written as the example of a new path (docs/architecture.md): this file and
one line in ``oktopk.paths``.
"""

import torch

from .path_bf16 import BF16


class FP16(BF16):
    name = "fp16"
    dtype = torch.float16
    described = "in float16"


PATH = FP16()
