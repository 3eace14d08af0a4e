"""On the CPU, the engine keeps each linear layer's weight transposed in memory.

`nn.Linear` computes x @ W.T with W stored (out, in) row by row. MKL's sgemm then copies (packs)
W at every call before multiplying, and with the few rows of a decode step (64 here) that copy
is a large share of the product: 12.6% of a decode step of the e2e benchmark's model, by
py-spy. Stored column-major (the same (out, in) tensor, laid out as its transpose), W.T is a
row-major (in, out) matrix that sgemm reads as it is: that model's 28 linear products at 64
rows took 2.90 ms against 3.70 ms, its whole decode step 6.64 ms against 7.72 ms, with the same
logits to the bit.

Only the memory layout changes: shapes, names and values stay, weight updates copy into the
parameters as before (a strided copy, about 3 ms more for that model's 3.2 M parameters), and a
parameter replaced wholesale (memory resumed from its offload file) gets the layout again.
Weights shared with another module (an output head tied to the embedding) keep theirs: the
embedding reads rows. Accelerators are left alone: their GEMMs take a transposed operand as it
is, and the gain was measured on the CPU only.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


def transpose_linear_weights(model: nn.Module, device: torch.device) -> int:
    """Lay out every unshared `nn.Linear` weight of `model` column-major when `device` is the
    CPU; returns how many weights changed layout."""
    if device.type != "cpu":
        return 0
    appearances = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or weight is None or appearances[id(weight)] > 1:
            continue
        if weight.dim() == 2 and weight.stride() == (weight.shape[1], 1):  # row-major now
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
            changed += 1
    return changed
