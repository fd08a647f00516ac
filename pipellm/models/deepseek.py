"""DeepSeek V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi K2 and Moonlight are V3, and GLM-4.7-Flash's
Glm4MoeLiteForCausalLM): Llama's block with multi-head latent attention (MLA), and experts routed by groups beside
shared experts (moe.py). GLM-4.5 (Glm4MoeForCausalLM: rotary on part of each head) and dots.llm1 (Dots1ForCausalLM:
Qwen3's q/k norms): Llama's attention with DeepSeek V3's experts.

MLA: a token's keys and values all come from one latent c (kv_lora_rank wide, RMS-normed) and one rotary key k_pe
(qk_rope_head_dim) that every head shares. The cache holds [c, k_pe] alone, one "head" a token that K and V share
(KVCache's shared): 576 values a token and layer in DeepSeek V3, where its 128 heads' keys and values are 40,960.
Attention runs on it directly, the heads' up-projection (kv_b_proj) absorbed into the query and the output, as vLLM's
and llama.cpp's MLA: head h's key is [W_UK_h c, k_pe] and its value W_UV_h c, so
    q_h . k_h = [W_UK_h^T q_nope_h, q_pe_h] . [c, k_pe],   out_h = W_UV_h (sum_j p_j c_j).
The checkpoint's rotary pairs are (2i, 2i+1) (V2 always, V3 with rope_interleave): their rows are reordered at load
into the (i, i + half) layout the rotary kernels turn, as glm.py's."""
import dataclasses
import math
import re

import torch
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import RMSNorm
from pipellm.models.llama import LlamaLayer, LlamaStage, gated_q_rows
from pipellm.models.rotary import RotaryEmbedding, apply_rotary

# DeepSeek's, MiniMax's, K-EXAONE's
SELECTION_BIAS = re.compile(r"\.(mlp\.gate|block_sparse_moe|mlp)\.e_score_correction_bias$")
SPLIT_UP = re.compile(r"\.self_attn\.(k|v)_b_proj\.weight$")  # llama.cpp's kv_b_proj, split
ROTARY_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)$")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's, whatever rms_norm_eps says (as HF and DeepSeek's)


class UpProjection(nn.Module):
    """kv_b_proj's weight [H * (nope + v), kv_lora_rank], read per head by the attention: not an nn.Linear, so
    neither quantized nor transposed at load."""

    def __init__(self, rows: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, rank))


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.rank, self.rope_dim = heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.v_dim = cfg.head_dim - cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = UpProjection(heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5 * yarn_scale(cfg) ** 2

    def forward(self, x, ropes, meta: AttentionMetadata, cache: KVCache):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(len(x), self.num_heads, -1)                                   # [T, H, nope + rope]
        latent = self.kv_a_proj_with_mqa(x)                                      # [T, rank + rope]
        c = self.kv_a_layernorm(latent[:, :self.rank])                           # [T, rank]
        q_pe, k_pe = apply_rotary(q[..., self.nope:], latent[:, None, self.rank:], *ropes[0])  # [T, H|1, rope]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)  # [H, nope + v, rank]
        q_c = torch.bmm(q[..., :self.nope].transpose(0, 1), w[:, :self.nope])     # [H, T, nope] @ [H, nope, rank]
        query = torch.cat([q_c.transpose(0, 1), q_pe], -1)                       # [T, H, rank + rope]
        key = torch.cat([c, k_pe[:, 0]], -1)[:, None]                            # [T, 1, rank + rope]
        if ropes.query_scale is not None:  # Mistral 4's temperature: on the whole q, so on its absorbed form
            query = query * ropes.query_scale
        out = paged_attention(query, key, key, cache, meta, self.scale)          # [T, H, rank + rope]
        # [H, T, rank] @ [H, rank, v] -> [H, T, v]: the values of each head from the latents it weighed
        values = torch.bmm(out[..., :self.rank].transpose(0, 1), w[:, self.nope:].transpose(1, 2))
        return self.o_proj(values.transpose(0, 1).reshape(len(x), -1))           # [T, H * v] -> [T, hidden]


def yarn_scale(cfg: ModelConfig) -> float:
    """YaRN's mscale of mscale_all_dim: DeepSeek scales every dim of q.k by its square (HF's yarn_apply_mscale)."""
    rope = cfg.rope
    if rope.rope_type == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0


class DeepseekLayer(LlamaLayer):
    attention_class = LatentAttention


class BiasedRouterStage(LlamaStage):
    """Llama's block whose router picks experts by their score plus a bias (e_score_correction_bias): DeepSeek's
    experts with GLM-4.5's and dots.llm1's attention as it is, with MLA as DeepSeek's; MiniMax-M2's (Mixtral's names,
    q/k norms over all heads)."""

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(SELECTION_BIAS.sub(".mlp.selection_bias",
                                                     name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")))


class GatedAttentionStage(BiasedRouterStage):
    """MiniCPM5-MoE: Llama's attention whose output a sigmoid of a second query gates (Qwen3-Next's, its q_proj
    laid out as Qwen3-Next's), DeepSeek V3's experts."""

    def row_order(self, name: str) -> torch.Tensor | None:
        return gated_q_rows(self.cfg) if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")) else None


class DeepseekStage(BiasedRouterStage):
    layer_class = DeepseekLayer

    def __init__(self, cfg: ModelConfig, stage):
        super().__init__(cfg, stage)
        # the whole rotary key turns (Mistral 4's config gives it as a share of q.k's width)
        rope = dataclasses.replace(cfg.rope, partial_rotary_factor=1.0)
        self.rotary = RotaryEmbedding(rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)

    def map_weight(self, name: str) -> list[tuple]:
        targets = super().map_weight(name)
        if ".self_attn.q_proj." in name:  # a whole q_proj (no q_lora_rank), not Llama's rows of qkv_proj
            return [(param.replace(".qkv_proj.", ".q_proj."), row) for param, row in targets]
        if (m := SPLIT_UP.search(name)) and targets:  # a GGUF file's k_b or v_b [heads, ...]: each head's rows
            cfg = self.cfg
            nope, width = cfg.head_dim - cfg.qk_rope_head_dim, cfg.head_dim - cfg.qk_rope_head_dim + cfg.v_head_dim
            param = targets[0][0].replace(f".{m[1]}_b_proj.", ".kv_b_proj.")
            return [(param, h * width + (nope if m[1] == "v" else 0), h) for h in range(cfg.num_heads)]
        return targets

    def row_order(self, name: str) -> torch.Tensor | None:
        """The rows of a checkpoint's tensor in this stage's layout (the rotary rows of q and k_pe reordered), or
        None: as they are."""
        if not self.cfg.rope_interleave or not (m := ROTARY_ROWS.search(name)):
            return None
        cfg, rope = self.cfg, self.cfg.qk_rope_head_dim
        pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])     # [rope]
        if m[1] == "kv_a_proj_with_mqa":                                             # [rank + rope]
            return torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + pairs])
        nope = cfg.head_dim - rope
        within = torch.cat([torch.arange(nope), nope + pairs])                      # [nope + rope] a head
        return (torch.arange(cfg.num_heads)[:, None] * cfg.head_dim + within).flatten()

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".k_b_proj.weight"):  # a GGUF file's k_b [heads, rank, nope]: each head's W_UK transposed
            return tensor.transpose(1, 2)
        return super().to_param_layout(name, tensor)
