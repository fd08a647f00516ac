"""`quantization="int8" | "int4"` for HF checkpoints: each linear weight rounded to the nearest level, per group of
32 inputs, into the layouts the GGUF path uses (int8: Q8_0's, symmetric; int4: Q4_1's, scale and min)."""
import logging

import torch
from torch import nn

from pipellm.quant.linear import Q4, Q8, CompactEmbedding, CompactLinear, QuantWeight

METHODS = ("int8", "int4")
GROUP = 32
ROWS = 256
log = logging.getLogger("pipellm")


def quantize(weight: torch.Tensor, method: str) -> QuantWeight:
    """weight [N, K] (K a multiple of 32) -> its compact form; every level is within half a step of the weight.
    ROWS rows at a time, so the fp32 temporaries stay small (a 7B model's 11008 x 4096 weight is 180 MB in fp32)."""
    first = _quantize_rows(weight[:ROWS], method)
    if weight.shape[0] <= ROWS:
        return first
    full = [None if t is None else t.new_empty((weight.shape[0], *t.shape[1:])) for t in first._tensors()]
    for i in range(0, weight.shape[0], ROWS):
        chunk = first if i == 0 else _quantize_rows(weight[i:i + ROWS], method)
        for dst, src in zip(full, chunk._tensors()):
            if dst is not None:
                dst[i:i + ROWS] = src
    return QuantWeight(first.kind, *full[:3], source=first.source)


def _quantize_rows(weight: torch.Tensor, method: str) -> QuantWeight:
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)                          # [N, K/32, 32]
    if method == "int8":
        scale = (w.abs().amax(-1) / 127).half()                                        # [N, K/32]
        s = scale.float()[..., None]
        q = torch.where(s > 0, w / s, torch.zeros_like(w)).round().clamp(-127, 127).to(torch.int8)
        return QuantWeight(Q8, q.reshape(n, k), scale, source="int8")
    lo, hi = w.amin(-1), w.amax(-1)
    scale, mins = ((hi - lo) / 15).half(), lo.half()
    s, m = scale.float()[..., None], mins.float()[..., None]
    q = torch.where(s > 0, (w - m) / s, torch.zeros_like(w)).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)                  # our Q4 layout: weight j low nibble, j + 16 high
    return QuantWeight(Q4, packed.reshape(n, k // 2), scale, mins, source="int4")


def quantized_linear(linear: nn.Linear, method: str) -> CompactLinear:
    bias = None if linear.bias is None else linear.bias.detach().float()
    return CompactLinear([quantize(linear.weight, method)], bias)


def quantize_linears(model: nn.Module, method: str) -> None:
    """Replaces every nn.Linear below model by its quantized CompactLinear (layers whose inputs are not a multiple
    of 32 stay as they are, with a note in the log)."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            if child.in_features % GROUP:
                log.info("%s stays unquantized: %d inputs is not a multiple of %d", name, child.in_features, GROUP)
                continue
            setattr(model, name, quantized_linear(child, method))
        else:
            quantize_linears(child, method)


class LoadQuantizer:
    """load_stage_weights' on_filled: replaces each nn.Linear below model by its quantized CompactLinear as soon as
    the linear's parameters are whole, and lets its dense weight go. The token embedding becomes int8 rows (Q8_0's
    layout, whichever the method: a lookup reads a few rows, and int4 would cost accuracy for little), expanded to
    dtype as they are looked up. Linears never completed this way (a weight tied to the embedding) are left to
    quantize_linears."""

    def __init__(self, model: nn.Module, method: str, dtype: torch.dtype = torch.float32):
        self.method, self.dtype = method, dtype
        self.waiting: dict[str, tuple[nn.Module, str, set[str]]] = {}  # module's name -> (parent, attribute, params)
        for parent_name, parent in model.named_modules():
            for attr, child in parent.named_children():
                if (isinstance(child, nn.Linear) and child.in_features % GROUP == 0 or
                        isinstance(child, nn.Embedding) and child.embedding_dim % GROUP == 0):
                    name = f"{parent_name}.{attr}" if parent_name else attr
                    self.waiting[name] = (parent, attr, {f"{name}.{p}" for p, _ in child.named_parameters()})

    def __call__(self, param_name: str) -> None:
        name = param_name.rpartition(".")[0]
        if name not in self.waiting:
            return
        parent, attr, missing = self.waiting[name]
        missing.discard(param_name)
        if not missing:
            del self.waiting[name]
            module = getattr(parent, attr)
            if isinstance(module, nn.Embedding):
                setattr(parent, attr, CompactEmbedding(quantize(module.weight, "int8"), self.dtype))
            else:
                setattr(parent, attr, quantized_linear(module, self.method))
