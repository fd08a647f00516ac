"""Falcon-H1 (FalconH1ForCausalLM): in every layer attention (Llama's, with rotary) and a Mamba-2 mixer
(linear_attention.py) side by side on the same normed input, their outputs added to the residual together, then a
SwiGLU MLP; the layer keeps a KV cache and a state (KVAndState). µP multipliers scale the attention's input and
output, the mixer's input, its in_proj's five parts and its output, and the MLP's gate and output (the key's and
the LM head's are ModelConfig's attention_multiplier and logits_scaling)."""
import torch

from pipellm.model_config import ModelConfig
from pipellm.models.layers import GatedMLP, RMSNorm
from pipellm.models.linear_attention import KVAndState, Mamba2Mixer
from pipellm.models.llama import LlamaLayer, LlamaStage, feed_forward_names


class FalconH1Mixer(Mamba2Mixer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.input_multiplier, self.part_multipliers = cfg.mup_multipliers[2], cfg.mup_multipliers[4:9]
        self._mup = None  # [inner + conv + heads]: each of z, x, B, C and dt its multiplier

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if self._mup is None or self._mup.device != x.device or self._mup.dtype != x.dtype:
            bc = self.groups * self.width
            sizes = (self.inner, self.inner, bc, bc, self.heads)
            self._mup = torch.cat([torch.full((n,), m) for n, m in zip(sizes, self.part_multipliers)]).to(x)
        return self.in_proj(x * self.input_multiplier) * self._mup


class FalconH1MLP(GatedMLP):
    """down(up(x) * silu(gate(x) * m_gate)) * m_down."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.gate_multiplier, self.down_multiplier = cfg.mup_multipliers[9:11]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, -1)
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1Layer(LlamaLayer):
    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__(cfg, layer, norm)
        self.mamba, self.mlp = FalconH1Mixer(cfg), FalconH1MLP(cfg)
        self.attention_in, self.attention_out, _, self.mamba_out = cfg.mup_multipliers[:4]

    def forward(self, x, ropes, meta, cache: KVAndState):
        h = self.input_layernorm(x)
        m = self.mamba(h, meta, cache.state) * self.mamba_out
        a = self.self_attn(h * self.attention_in, ropes, meta, cache.kv) * self.attention_out
        x = x + (m + a)
        return x + self.mlp(self.post_attention_layernorm(x))


class FalconH1Stage(LlamaStage):
    layer_class = FalconH1Layer

    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(feed_forward_names(name))
