"""Gemma 2 and Gemma 3 (text): the Llama block with norms after attention and MLP too, 1 + w RMSNorms, a scaled
embedding, GeGLU, and for Gemma 2 soft-capped attention scores and logits. Gemma 3 adds q/k norms and gives its
sliding (local) and full (global) layers rotary positions of their own. Gemma 1: Llama's block with these norms,
embedding and GeGLU; VaultGemma: Gemma 1's block (its MLP's norm named pre_feedforward_layernorm) with Gemma 2's
soft caps and sliding layers. Gemma 4: Gemma 3's layer with plain norms, weightless-normed values, unscaled
attention, full-attention layers of wider heads (their values their keys' projection, where k_eq_v says) whose rotary
turns a quarter of each, a learned scale on each layer's output, and experts beside the MLP in its MoE models."""
import re

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.attention import paged_attention
from pipellm.models.layers import Fp32ScaledRMSNorm, GatedMLP, GemmaRMSNorm
from pipellm.models.llama import LAYER_NAME, LlamaAttention, LlamaLayer, LlamaStage
from pipellm.models.moe import run_experts
from pipellm.models.rotary import apply_rotary

STACKED = re.compile(r"^experts\.(gate_up_proj|down_proj)$")  # Gemma 4's experts, [E, out, in]
EXPERT_HALF = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj)\.weight$")  # one expert's, from a GGUF file


class GemmaLayer(nn.Module):
    """Also GLM-4's layer (glm.py), with plain RMSNorms, and AFMoE's (afmoe.py) with its experts."""
    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer: int, norm=GemmaRMSNorm):
        super().__init__()
        size, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = norm(size, eps)
        self.self_attn = self.attention_class(cfg, layer, norm=norm)
        self.post_attention_layernorm = norm(size, eps)
        self.pre_feedforward_layernorm = norm(size, eps)
        self.mlp = self.build_mlp(cfg, layer)
        self.post_feedforward_layernorm = norm(size, eps)

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

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


class Gemma4Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int, norm=Fp32ScaledRMSNorm):
        super().__init__(cfg, layer, norm)
        self.values_are_keys = cfg.values_are_keys(layer)  # then qkv_proj holds q and k only

    def forward(self, x, ropes, meta, cache):
        qkv = self.qkv_proj(x)                             # [T, (H + 2 KV) * D], or [T, (H + KV) * D]
        q = qkv[..., :self.q_size].view(-1, self.num_heads, self.head_dim)                          # [T, H, D]
        k = qkv[..., self.q_size:self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        v = k if self.values_are_keys else qkv[..., self.q_size + self.kv_size:].view_as(k)     # [T, KV, D]
        v = F.rms_norm(v.float(), v.shape[-1:], eps=self.eps).to(v.dtype)  # no weight, in fp32 (as HF)
        q, k = apply_rotary(*self.qk_norm(q, k), *ropes[self.is_sliding])
        out = paged_attention(q, k, v, cache, meta.local if self.is_sliding else meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))  # [T, H * D] -> [T, hidden]


class Gemma4Router(nn.Module):
    """Top-k experts of each token by the softmax of its weightless-normed residual, scaled per channel; their
    weights renormalised to sum to 1, then scaled per expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.eps = cfg.num_experts_per_tok, cfg.norm_eps
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        probs = torch.softmax(self.proj(h * self.scale * x.shape[-1] ** -0.5), -1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)                                         # [T, k]
        return weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[chosen], chosen


class Gemma4Layer(GemmaLayer):
    attention_class = Gemma4Attention

    def __init__(self, cfg: ModelConfig, layer: int, norm=Fp32ScaledRMSNorm):
        super().__init__(cfg, layer, norm)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        if cfg.num_experts:
            size, eps = cfg.hidden_size, cfg.norm_eps
            self.router = Gemma4Router(cfg)
            self.experts = nn.ModuleList(GatedMLP(size, cfg.moe_intermediate_size, cfg.hidden_act)
                                         for _ in range(cfg.num_experts))
            self.pre_feedforward_layernorm_2 = norm(size, eps)
            self.post_feedforward_layernorm_1 = norm(size, eps)
            self.post_feedforward_layernorm_2 = norm(size, eps)

    def forward(self, x, ropes, meta, cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ropes, meta, cache))
        m = self.mlp(self.pre_feedforward_layernorm(x))
        if hasattr(self, "router"):  # the experts take the residual, beside the MLP
            routed = run_experts(self.experts, self.pre_feedforward_layernorm_2(x), *self.router(x))
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        return (x + self.post_feedforward_layernorm(m)) * self.layer_scalar


class Gemma4Stage(GemmaStage):
    layer_class, norm_class = Gemma4Layer, Fp32ScaledRMSNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        m = LAYER_NAME.match(name)
        if not m or not self.stage.start <= int(m[1]) < self.stage.end:
            return super().map_weight(name)
        prefix = f"layers.{int(m[1]) - self.stage.start}.experts."
        if stacked := STACKED.match(m[2]):  # each expert's slice fills its own layer
            return [(f"{prefix}{e}.{stacked[1]}.weight", 0, e) for e in range(self.cfg.num_experts)]
        if half := EXPERT_HALF.match(m[2]):
            return [(f"{prefix}{half[1]}.gate_up_proj.weight", self.cfg.moe_intermediate_size * (half[2] == "up_proj"))]
        return super().map_weight(name)
