"""Nemotron-H (NemotronHForCausalLM: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano and Super): a layer is a norm
and one mixer whose output joins the residual: a Mamba-2 mixer (linear_attention.py), attention without rotary, a
relu^2 MLP, or relu^2 experts behind DeepSeek V3's router with a relu^2 shared expert (moe.py; Super's on a latent
projection). Its MLP and experts layers cache nothing."""
import re

from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.layers import Fp32ScaledRMSNorm
from pipellm.models.linear_attention import Mamba2Mixer
from pipellm.models.llama import LlamaAttention, LlamaStage, make_mlp

MIXERS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}  # held as
LAYER_PART = re.compile(r"^model\.layers\.(\d+)\.(norm|mixer)\.")  # a layer's norm or its one mixer


class NemotronHLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=Fp32ScaledRMSNorm):
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps)
        self.kind = cfg.layer_types[layer]
        if self.kind == "linear_attention":
            self.mamba = Mamba2Mixer(cfg)
        elif self.kind == "full_attention":
            self.self_attn = LlamaAttention(cfg, layer, norm)
        else:
            self.mlp = make_mlp(cfg, layer)

    def forward(self, x, ropes, meta, cache):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            return x + self.mamba(h, meta, cache)
        if self.kind == "full_attention":
            return x + self.self_attn(h, ropes, meta, cache)
        return x + self.mlp(h)


class NemotronHStage(LlamaStage):
    layer_class, norm_class = NemotronHLayer, Fp32ScaledRMSNorm  # its norms scale in fp32, rounded once

    def map_weight(self, name: str) -> list[tuple]:
        """Its checkpoints' names (backbone.layers.N.mixer.*) as Llama's, a layer's mixer under what it holds."""
        name = name.replace("backbone.", "model.", 1).replace("model.embeddings.", "model.embed_tokens.") \
            .replace("model.norm_f.", "model.norm.")
        if (m := LAYER_PART.match(name)) and int(m[1]) < self.cfg.num_layers:
            held = "input_layernorm" if m[2] == "norm" else MIXERS[self.cfg.layer_types[int(m[1])]]
            name = f"model.layers.{m[1]}.{held}.{name[m.end():]}".replace(".shared_experts.", ".shared_expert.") \
                .replace(".gate.e_score_correction_bias", ".selection_bias")
        return super().map_weight(name)
