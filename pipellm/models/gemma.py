"""Gemma 2 and Gemma 3 (text): the Llama block with norms after attention and MLP too, 1 + w RMSNorms, a scaled
embedding, GeGLU, and for Gemma 2 soft-capped attention scores and logits. Gemma 3 adds q/k norms and gives its
sliding (local) and full (global) layers rotary positions of their own. Gemma 1: Llama's block with these norms,
embedding and GeGLU; VaultGemma: Gemma 1's block (its MLP's norm named pre_feedforward_layernorm) with Gemma 2's
soft caps and sliding layers."""
import torch
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.layers import GatedMLP, GemmaRMSNorm
from pipellm.models.llama import LlamaAttention, LlamaLayer, LlamaStage


class GemmaLayer(nn.Module):
    """Also GLM-4's layer (glm.py), with plain RMSNorms."""

    def __init__(self, cfg: ModelConfig, layer: int, norm=GemmaRMSNorm):
        super().__init__()
        size, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = norm(size, eps)
        self.self_attn = LlamaAttention(cfg, layer, norm=norm)
        self.post_attention_layernorm = norm(size, eps)
        self.pre_feedforward_layernorm = norm(size, eps)
        self.mlp = GatedMLP(size, cfg.intermediate_size, cfg.hidden_act)
        self.post_feedforward_layernorm = norm(size, eps)

    def forward(self, x, ropes, meta, cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ropes, meta, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaStage(LlamaStage):
    layer_class, norm_class = GemmaLayer, GemmaRMSNorm

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)  # rounded to the model's dtype, as HF

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # capped logits can tie where the raw ones do not, and the first of them is the pick
        return super().greedy_ids(hidden) if self.cfg.final_logit_softcapping is None else None


class Gemma1Stage(GemmaStage):
    layer_class = LlamaLayer  # with GemmaStage's 1 + w norms


class VaultGemmaStage(Gemma1Stage):
    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."))
