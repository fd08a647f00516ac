"""Cohere's Command R (CohereForCausalLM) and Command R7B/A (Cohere2ForCausalLM): attention and MLP side by side on
one LayerNorm's output (no bias), rotary pairs interleaved, logits scaled; Cohere 2's full layers (among sliding
ones) take no rotary positions. Cohere 2 MoE: experts after its first dense layers, with shared ones (moe.py)."""
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.glm import InterleavedRotaryStage
from pipellm.models.layers import CohereLayerNorm
from pipellm.models.llama import LlamaAttention, make_mlp


class CohereLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=CohereLayerNorm):
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, norm)
        self.mlp = make_mlp(cfg, layer)

    def forward(self, x, ropes, meta, cache):
        h = self.input_layernorm(x)
        return x + self.self_attn(h, ropes, meta, cache) + self.mlp(h)


class CohereStage(InterleavedRotaryStage):
    layer_class, norm_class = CohereLayer, CohereLayerNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))  # Cohere 2 MoE's
