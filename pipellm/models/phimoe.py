"""Phi-MoE (Phi-3.5-MoE): Mixtral's layers and names (moe.py's experts, two a token picked by sparsemixer), with
LayerNorms that have biases, attention with biases, and an LM head with a bias."""
from torch import nn

from pipellm.models.llama import LlamaStage


class PhimoeStage(LlamaStage):
    norm_class = nn.LayerNorm  # (size, eps), with a bias; LlamaStage gives the LM head its bias (lm_head_bias)

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        if name in ("model.norm.bias", "lm_head.bias"):
            return [(name.removeprefix("model."), 0)] if self.stage.is_last else []
        return super().map_weight(name)
