"""GPT-2: LayerNorm, learned positions, multi-head attention, GELU MLP. HF stores its linears as Conv1D ([in, out])."""
import re

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.layers import greedy_head
from pipellm.pipeline.partition import StageLayers

LAYER_NAME = re.compile(r"^h\.(\d+)\.(.+)$")
CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, meta: AttentionMetadata, cache):
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # [T, 3, H, D] -> 3 x [T, H, D]
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.c_proj(out.reshape(x.shape))             # [T, H, D] -> [T, hidden]


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, meta, cache):
        x = x + self.attn(self.ln_1(x), meta, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Stage(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageLayers):
        super().__init__()
        self.cfg, self.stage = cfg, stage
        if stage.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(stage.num_layers))
        if stage.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.h

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        if self.stage.is_first:
            x = self.embed(x, positions)
        return self.run_layers(x, positions, meta, kv_caches)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(positions)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches):
        for block, cache in zip(self.h, kv_caches):
            x = block(x, meta, cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return greedy_head(self.lm_head, self.ln_f(hidden))

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        stage = self.stage
        name = name.removeprefix("transformer.")
        if name == "wte.weight":
            targets = [(name, 0)] if stage.is_first else []
            if stage.is_last and self.cfg.tie_word_embeddings:
                targets.append(("lm_head.weight", 0))
            return targets
        if name == "wpe.weight":
            return [(name, 0)] if stage.is_first else []
        if name.startswith("ln_f.") or name == "lm_head.weight":
            return [(name, 0)] if stage.is_last else []
        m = LAYER_NAME.match(name)
        if not m or not stage.start <= int(m[1]) < stage.end:
            return []
        return [(f"h.{int(m[1]) - stage.start}.{m[2]}", 0)]

    @staticmethod
    def to_param_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if CONV1D.search(name) else tensor  # Conv1D [in, out] -> Linear [out, in]
