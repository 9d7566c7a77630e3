"""oneDNN linear for fp32 on CPU, with weights prepacked for batched GEMM.

Measured on the CI CPU (AVX2, 2 cores), SmolLM2-135M's linears with cold weights:
rows 1: reference 19.5 ms, packed 24.7 ms; rows 4: 34.9 vs 29.4 ms; rows 16: 66.5 vs 42.6 ms.
So one or two rows (batch-1 decode) take the reference GEMV on the plain weight, more
rows take oneDNN on a packed copy, made on first use: batch-1 use costs no extra memory,
serving pays one packed copy of the linear weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.packed import PackedWeights
from kiln.kernels.registry import register

# Rows at which the packed GEMM starts to win (see the measurements above).
PACKED_FROM_ROWS = 3
_PACK_BATCH_HINT = 16
_packed = PackedWeights(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT))


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


if available():

    @register("linear", backend="onednn", devices=("cpu",))
    def linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.shape[0] < PACKED_FROM_ROWS or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, _packed.get(weight), bias, "none", [], "")
