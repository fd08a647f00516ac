"""Llama, Mistral and Qwen2: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP."""
import re

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.config import ModelConfig
from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from pipellm.pipeline.partition import StageLayers

KVCache = tuple[torch.Tensor, torch.Tensor]
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one weight read and one kernel call instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, rope, meta: AttentionMetadata, cache: KVCache):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)        # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)     # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))     # [T, H * D] -> [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused, as qkv
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, rope, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """The slice of a Llama-family model that one pipeline stage holds."""

    def __init__(self, cfg: ModelConfig, stage: StageLayers):
        super().__init__()
        self.cfg, self.stage = cfg, stage
        if stage.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(stage.num_layers))
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden states [T, hidden]. Returns hidden [T, hidden]."""
        if self.stage.is_first:
            x = self.embed_tokens(x)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, rope, meta, cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        """Checkpoint tensor name -> [(parameter, first row it fills)] on this stage; [] if another stage owns it."""
        stage, cfg = self.stage, self.cfg
        if name == "model.embed_tokens.weight":
            targets = [("embed_tokens.weight", 0)] if stage.is_first else []
            if stage.is_last and cfg.tie_word_embeddings:
                targets.append(("lm_head.weight", 0))
            return targets
        if name in ("model.norm.weight", "lm_head.weight"):
            return [(name.removeprefix("model."), 0)] if stage.is_last else []
        m = LAYER_NAME.match(name)
        if not m or not stage.start <= int(m[1]) < stage.end:
            return []
        prefix, rest = f"layers.{int(m[1]) - stage.start}.", m[2]
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        fused = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", q),
                 "self_attn.v_proj": ("self_attn.qkv_proj", q + kv), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
                 "mlp.up_proj": ("mlp.gate_up_proj", inter)}
        module, _, kind = rest.rpartition(".")
        if module in fused:
            target, row = fused[module]
            return [(f"{prefix}{target}.{kind}", row)]
        return [(prefix + rest, 0)]
