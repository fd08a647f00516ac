"""Families from before Llama's block settled: LayerNorms, biases, MLPs without a gate (layers.GeluMLP, relu^2), rotary
on part of each head. GPT-NeoX (Pythia): attention and MLP side by side on two norms of the same input (or one after
the other), q, k and v rows interleaved by head; Phi (phi-1.5, phi-2): side by side on one norm; StarCoder2: Llama's
block, its layers all windowed when it gives a window; Nemotron (Nemotron-4, Minitron): Llama's block with 1 + w
LayerNorms and a relu^2 MLP; StableLM: Llama's block with LayerNorms, or attention and MLP side by side on one."""
import torch
from torch import nn

from pipellm.family_config import NEOX_NAMES, PHI_NAMES, STARCODER2_NAMES, renamed
from pipellm.models.cohere import CohereLayer
from pipellm.models.layers import LayerNorm1p
from pipellm.models.llama import LlamaLayer, LlamaStage


class NeoXLayer(LlamaLayer):
    def __init__(self, cfg, layer, norm=nn.LayerNorm):
        super().__init__(cfg, layer, norm)
        self.parallel = cfg.parallel_residual

    def forward(self, x, ropes, meta, cache):
        if not self.parallel:
            return super().forward(x, ropes, meta, cache)
        return x + self.self_attn(self.input_layernorm(x), ropes, meta, cache) + \
            self.mlp(self.post_attention_layernorm(x))


class NeoXStage(LlamaStage):
    layer_class, norm_class = NeoXLayer, nn.LayerNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        if name.endswith((".attention.bias", ".attention.masked_bias")):  # older checkpoints' causal masks
            return []
        return super().map_weight(renamed(name, NEOX_NAMES))

    def row_order(self, name: str) -> torch.Tensor | None:
        """query_key_value's rows [H, 3, D] (each head's q, k, v) in qkv_proj's order [3, H, D]."""
        if ".attention.query_key_value." not in name:
            return None
        heads, d = self.cfg.num_heads, self.cfg.head_dim
        return (torch.arange(heads)[None, :, None] * 3 * d + torch.arange(3)[:, None, None] * d
                + torch.arange(d)).flatten()


class PhiStage(LlamaStage):
    layer_class, norm_class = CohereLayer, nn.LayerNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(renamed(name, PHI_NAMES))


class Starcoder2Stage(LlamaStage):
    norm_class = nn.LayerNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(renamed(name, STARCODER2_NAMES))


class NemotronStage(LlamaStage):
    norm_class = LayerNorm1p


class StableLmLayer(LlamaLayer):
    def __init__(self, cfg, layer, norm=nn.LayerNorm):
        super().__init__(cfg, layer, norm)
        self.parallel = cfg.parallel_residual
        if self.parallel:  # one norm: its input's
            del self.post_attention_layernorm

    def forward(self, x, ropes, meta, cache):
        if not self.parallel:
            return super().forward(x, ropes, meta, cache)
        h = self.input_layernorm(x)
        return x + self.self_attn(h, ropes, meta, cache) + self.mlp(h)


class StableLmStage(LlamaStage):
    layer_class, norm_class = StableLmLayer, nn.LayerNorm
