"""GPT-OSS (GptOssForCausalLM): the Llama block with attention sinks (a learned logit per head in each softmax's
denominator, attention.py), sliding and full layers, and a mixture of biased, clamped SwiGLU experts (moe.py). The
checkpoint stacks a layer's experts in one tensor each, [experts, in, out] with gate and up columns interleaved; at
load they become each expert's nn.Linear rows, gate rows then up rows, as the other families' experts."""
import re

import torch

from pipellm.models.llama import LAYER_NAME, LlamaStage

STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple]:
        m = LAYER_NAME.match(name)
        if not m or not (stacked := STACKED.match(m[2])):
            return super().map_weight(name.replace(".mlp.router.", ".mlp.gate."))
        layer = int(m[1])
        if not self.stage.start <= layer < self.stage.end:
            return []
        kind = "bias" if stacked[2] else "weight"
        return [(f"layers.{layer - self.stage.start}.mlp.experts.{e}.{stacked[1]}.{kind}", 0, e)
                for e in range(self.cfg.num_experts)]

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        m = LAYER_NAME.match(name)
        stacked = STACKED.match(m[2]) if m else None
        if stacked is None:
            return tensor
        if not stacked[2]:
            tensor = tensor.transpose(1, 2)                   # [E, in, out] -> [E, out, in], nn.Linear's rows
        if stacked[1] == "gate_up_proj":  # columns gate0, up0, gate1, up1, ... -> the gates, then the ups
            width = tensor.shape[1]
            tensor = tensor[:, torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])]
        return tensor.contiguous()
