"""Llama 2/3, Mistral, Ministral, Qwen2, Qwen3, Phi-3, Seed-OSS, SmolLM3 (no rotary in every 4th layer), Granite
(scaled embedding, residual branches and logits), and with moe.py Mixtral, Qwen2-MoE and Qwen3-MoE: RMSNorm, rotary
positions, grouped-query attention, SwiGLU MLP. Gemma and GLM-4 (gemma.py, glm.py) and OLMo and EXAONE 4 (olmo.py)
change the norms and the order around them; GPT-OSS (gpt_oss.py) adds attention sinks and its own experts."""
import re

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models import fused
from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import RMSNorm, dense_mlp, greedy_head
from pipellm.models.moe import SparseMoE
from pipellm.models.rotary import RotaryEmbedding, StepRopes, apply_rotary, query_scale
from pipellm.pipeline.partition import StageLayers

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# an expert's MLP: Mixtral's block_sparse_moe.experts.E.w1/w3/w2, Qwen3-MoE's mlp.experts.E.gate/up/down_proj
EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)$")
# a layer's experts stacked, as transformers 5 holds them: gate_up_proj [E, 2 * width, hidden] (each expert's gate
# rows, then its up rows), down_proj [E, hidden, width]
STACKED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
IN_OUT_EXPERTS = re.compile(r"\.(?:mlp|feed_forward)\.experts\.(?:gate_up_proj|down_proj)$")  # Llama 4's names too


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__()
        self.num_heads, (self.num_kv_heads, self.head_dim) = cfg.num_heads, cfg.attention_shape(layer)
        self.q_size, self.kv_size = cfg.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.gate_size = self.q_size if cfg.attention_output_gate else 0  # Qwen3-Next's: rows after q's
        # q, k and v in one matmul: one weight read and one kernel call instead of three (v none where the values
        # are the keys' projection: Gemma 4's, gemma.py)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + self.gate_size
                                  + (1 + (not cfg.values_are_keys(layer))) * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # over each head's values, or (OLMo) over all of a token's q and all of its k
            q_n, k_n = (self.head_dim, self.head_dim) if cfg.qk_norm_per_head else (self.q_size, self.kv_size)
            self.q_norm, self.k_norm = norm(q_n, cfg.norm_eps), norm(k_n, cfg.norm_eps)
        self.norm_after_rope = cfg.qk_norm_after_rope
        self.is_sliding = cfg.is_sliding(layer)
        self.rotary = layer not in cfg.nope_layers
        self.l2_qk_norm, self.eps = cfg.qk_l2_norm and self.rotary, cfg.norm_eps
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None  # GPT-OSS

    def forward(self, x, ropes: StepRopes, meta: AttentionMetadata, cache: KVCache):
        qkv = self.qkv_proj(x)                               # [T, (H + 2 KV) * D]; slices cost less than split
        q = qkv[..., :self.q_size].view(-1, self.num_heads, self.head_dim)                           # [T, H, D]
        k_at = self.q_size + self.gate_size
        k = qkv[..., k_at:k_at + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)          # [T, KV, D]
        v = qkv[..., k_at + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.norm_after_rope:
            q, k = self.qk_norm(q, k)
        if self.rotary:
            q, k = apply_rotary(q, k, *ropes[self.is_sliding])
        if self.norm_after_rope:
            q, k = self.qk_norm(q, k)
        if self.l2_qk_norm:  # Llama 4's, weightless, in fp32 (as HF)
            q, k = (F.rms_norm(t.float(), t.shape[-1:], eps=self.eps).to(t.dtype) for t in (q, k))
        if (scale := ropes.query_scale if self.rotary else ropes.nope_query_scale) is not None:
            q = q * scale
        out = paged_attention(q, k, v, cache, meta.local if self.is_sliding else meta, self.scale,
                              self.softcap, self.sinks).reshape(-1, self.q_size)                  # [T, H * D]
        if self.gate_size:
            out = out * torch.sigmoid(qkv[..., self.q_size:k_at])
        return self.o_proj(out)                              # [T, H * D] -> [T, hidden]

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Over [T * heads, D], or [T, heads * D] (OLMo)."""
        q = self.q_norm(q.reshape(-1, self.q_norm.weight.numel())).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.k_norm.weight.numel())).view(-1, self.num_kv_heads, self.head_dim)
        return q, k


def gated_q_rows(cfg: ModelConfig) -> torch.Tensor:
    """q_proj's rows of an attention with an output gate, as [q of every head, then the gate of every head], from the
    checkpoints' (per head, its q then its gate)."""
    return torch.arange(2 * cfg.num_heads * cfg.head_dim).view(cfg.num_heads, 2, -1).transpose(0, 1).flatten()


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.is_moe(layer):
        return SparseMoE(cfg)
    return dense_mlp(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias, gated=cfg.gated_mlp)


class LlamaLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = self.attention_class(cfg, layer, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = make_mlp(cfg, layer)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, ropes, meta, cache):
        r = self.residual_multiplier
        a = self.mix(self.input_layernorm(x), ropes, meta, cache)
        x = x + (a if r == 1 else a * r)
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (m if r == 1 else m * r)

    def mix(self, h, ropes, meta, cache):
        """The layer's token mixer on its normed input: attention."""
        return self.self_attn(h, ropes, meta, cache)


class StateLayer(LlamaLayer):
    """A layer of a model whose "linear_attention" layers mix tokens with mixer_class (linear_attention.py: a state
    per sequence, no KV cache), held under mixer_name as the checkpoint names it, in place of attention."""
    mixer_name: str
    mixer_class: type

    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__(cfg, layer, norm)
        self.keeps_state = cfg.is_linear(layer)
        if self.keeps_state:
            del self.self_attn
            setattr(self, self.mixer_name, self.mixer_class(cfg))

    def mix(self, h, ropes, meta, cache):
        if self.keeps_state:
            return getattr(self, self.mixer_name)(h, meta, cache)
        return self.self_attn(h, ropes, meta, cache)


def feed_forward_names(name: str) -> str:
    """Falcon-H1's, Jamba's and Bamba's checkpoint names as Llama's: feed_forward the MLP (its router the gate),
    pre_ff_layernorm its norm, final_layernorm the last norm."""
    return name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.").replace(
        ".pre_ff_layernorm.", ".post_attention_layernorm.").replace("model.final_layernorm.", "model.norm.")


class LlamaStage(nn.Module):
    """The slice of a Llama-family model that one pipeline stage holds. Its layers take its norm_class too."""

    layer_class, norm_class = LlamaLayer, RMSNorm

    def __init__(self, cfg: ModelConfig, stage: StageLayers):
        super().__init__()
        self.cfg, self.stage = cfg, stage
        if stage.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, self.norm_class) for i in range(stage.start, stage.end))
        if stage.is_last:
            self.norm = self.norm_class(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.global_head_dim or cfg.head_dim, cfg.max_position_embeddings)
        self.rotary_local = None if cfg.rope_local is None else \
            RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings)
        self._fused = None  # (the caches it was built for, the kernels' DecoderStack or None): decode steps

    def _apply(self, fn, recurse=True):
        self._fused = None  # moved or cast: built again from the new tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden states [T, hidden]. Returns hidden [T, hidden]."""
        if self.stage.is_first:
            x = self.embed(x, positions)
        return self.run_layers(x, positions, meta, kv_caches)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x if self.cfg.embedding_multiplier == 1 else x * self.cfg.embedding_multiplier

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[KVCache]) -> torch.Tensor:
        seq_ends = meta.token_rope_lens if self.rotary.scaled_from is not None else None
        rope = self.rotary.tables(positions, x.dtype, seq_ends)  # once per step, for every layer
        cfg = self.cfg
        scale = query_scale(cfg.rope.llama4_scaling_beta, cfg.rope.original_max_position_embeddings, positions,
                            x.dtype)
        nope_scale = query_scale(cfg.nope_temperature[1], cfg.nope_temperature[0], positions + 1, x.dtype) \
            if cfg.nope_temperature else scale
        ropes = StepRopes(rope, rope if self.rotary_local is None else self.rotary_local.tables(positions, x.dtype),
                          scale, nope_scale)
        if scale is None and nope_scale is None and fused.applies(x, meta):  # the kernels scale no query
            if self._fused is None or self._fused[0] is not kv_caches:
                self._fused = (kv_caches, fused.build_stack(self.layers, kv_caches))
            if self._fused[1] is not None:
                return self._fused[1].decode(x, *fused.step_args(meta, ropes.full, ropes.local),
                                             fused.lora_rows(self.layers))
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, meta, cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return logits if self.cfg.logits_scaling == 1 else logits / self.cfg.logits_scaling

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token (its first largest logit) where the LM head finds it without every logit; None
        where it cannot, and compute_logits is the way (scaled logits can tie where the raw ones do not)."""
        return greedy_head(self.lm_head, self.norm(hidden)) if self.cfg.logits_scaling == 1 else None

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Stacked experts as nn.Linear's [E, out, in]: those given [E, in, out] transposed (Llama 4's checkpoints,
        Qwen3-VL-MoE's releases; told apart by their shape, as HF does, a square one by experts_in_out)."""
        if name.endswith(".conv1d.weight"):  # a linear-attention or Mamba-2 layer's: HF's [C, 1, kernel]
            return tensor.reshape(tensor.shape[0], -1)
        if not IN_OUT_EXPERTS.search(name):
            return tensor
        cfg = self.cfg
        out_in = (2 * cfg.moe_intermediate_size, cfg.hidden_size) if name.endswith("gate_up_proj") else \
            (cfg.hidden_size, cfg.moe_intermediate_size)
        square = out_in[0] == out_in[1]
        return tensor.transpose(1, 2) if tuple(tensor.shape[1:]) != out_in or square and cfg.experts_in_out \
            else tensor

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        """Checkpoint tensor name -> [(parameter, first row it fills)] on this stage; [] if another stage owns it."""
        stage, cfg = self.stage, self.cfg
        if name == "model.embed_tokens.weight":
            targets = [("embed_tokens.weight", 0)] if stage.is_first else []
            if stage.is_last and cfg.tie_word_embeddings:
                targets.append(("lm_head.weight", 0))
            return targets
        if name in ("model.norm.weight", "model.norm.bias", "lm_head.weight", "lm_head.bias"):  # biases: LayerNorm's
            return [(name.removeprefix("model."), 0)] if stage.is_last else []
        m = LAYER_NAME.match(name)
        if not m or not stage.start <= int(m[1]) < stage.end:
            return []
        prefix, rest = f"layers.{int(m[1]) - stage.start}.", m[2]
        kv_heads, head_dim = cfg.attention_shape(int(m[1]))
        # q_proj's rows hold the output gate's after q's, where there is one (gated_q_rows)
        q, kv, inter = cfg.num_heads * head_dim * (1 + cfg.attention_output_gate), kv_heads * head_dim, \
            cfg.intermediate_size
        fused = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", q),
                 "self_attn.v_proj": ("self_attn.qkv_proj", q + kv), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
                 "mlp.up_proj": ("mlp.gate_up_proj", inter),
                 "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
                 "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", cfg.shared_expert_intermediate_size)}
        if rest == "block_sparse_moe.gate.weight":
            return [(prefix + "mlp.gate.weight", 0)]
        if m := STACKED_EXPERTS.match(rest):  # each expert's slice fills its own layer
            return [(f"{prefix}mlp.experts.{e}.{m[1]}.weight", 0, e) for e in range(cfg.num_experts)]
        if m := EXPERT.match(rest):
            expert, proj, kind = m[1], m[2], m[3]
            target = "down_proj" if proj in ("w2", "down_proj") else "up_proj" if not cfg.gated_mlp \
                else "gate_up_proj"  # Nemotron-H's experts have no gate
            row = cfg.moe_intermediate_size if proj in ("w3", "up_proj") and target == "gate_up_proj" else 0
            return [(f"{prefix}mlp.experts.{expert}.{target}.{kind}", row)]
        module, _, kind = rest.rpartition(".")
        if module.endswith(".conv1d"):  # a linear-attention or Mamba-2 layer's convolution
            return [(f"{prefix}{module.removesuffix('conv1d')}conv_{kind}", 0)]
        if module in fused and (cfg.gated_mlp or not module.endswith("up_proj")):  # an up_proj without a gate: alone
            target, row = fused[module]
            return [(f"{prefix}{target}.{kind}", row)]
        return [(prefix + rest, 0)]
