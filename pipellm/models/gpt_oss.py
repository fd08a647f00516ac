"""GPT-OSS (GptOssForCausalLM): the Llama block with attention sinks (a learned logit per head in each softmax's
denominator, attention.py), sliding and full layers, and a mixture of biased, clamped SwiGLU experts (moe.py). The
checkpoint stacks a layer's experts in one tensor each, [experts, in, out] (or MXFP4 blocks [experts, out, ...]), gate
and up interleaved (gate 0, up 0, gate 1, ...); at load each expert's slice becomes its nn.Linear's rows, the gates'
then the ups', as the other families' experts and GGUF's."""
import re

import torch

from pipellm.models.layers import Fp32ScaledRMSNorm
from pipellm.models.llama import LAYER_NAME, LlamaStage

STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


class GptOssStage(LlamaStage):
    norm_class = Fp32ScaledRMSNorm

    def map_weight(self, name: str) -> list[tuple]:
        m = LAYER_NAME.match(name)
        if not m or not (stacked := STACKED.match(m[2])) or stacked[2] in ("_blocks", "_scales"):
            return super().map_weight(name.replace(".mlp.router.", ".mlp.gate."))
        layer = int(m[1])
        if not self.stage.start <= layer < self.stage.end:
            return []
        kind = "bias" if stacked[2] else "weight"
        return [(f"layers.{layer - self.stage.start}.mlp.experts.{e}.{stacked[1]}.{kind}", 0, e)
                for e in range(self.cfg.num_experts)]

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Stacked expert tensors as [E, out, ...] in the module's row order: the weights transposed ([E, in, out]
        -> nn.Linear's [E, out, in]; MXFP4 blocks and scales come as [E, out, ...]), gate/up rows de-interleaved."""
        m = LAYER_NAME.match(name)
        stacked = STACKED.match(m[2]) if m else None
        if stacked is None:
            return tensor
        if not stacked[2]:
            tensor = tensor.transpose(1, 2)
        if stacked[1] == "gate_up_proj":  # rows (bias: columns) gate 0, up 0, gate 1, ... -> the gates, then the ups
            width = tensor.shape[1]
            tensor = tensor[:, torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])]
        return tensor
