"""Nemotron-H (NemotronHForCausalLM: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): each layer is a norm and one
mixer whose output joins the residual: a Mamba-2 mixer (linear_attention.py), attention without rotary, a relu^2 MLP,
or relu^2 experts behind DeepSeek V3's router with a relu^2 shared expert (moe.py). Its MLP and experts layers cache
nothing."""
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.layers import Fp32ScaledRMSNorm
from pipellm.models.linear_attention import Mamba2Mixer
from pipellm.models.llama import LlamaAttention, LlamaStage, make_mlp

MIXERS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}  # held as


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
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit():
            kind = self.cfg.layer_types[int(parts[2])] if int(parts[2]) < self.cfg.num_layers else "mlp"
            rest = ".".join(parts[3:]).replace("norm.", "input_layernorm.", 1) if parts[3] == "norm" else \
                ".".join(parts[3:]).replace("mixer.", MIXERS[kind] + ".", 1).replace(
                    ".shared_experts.", ".shared_expert.").replace(".gate.e_score_correction_bias", ".selection_bias")
            name = f"model.layers.{parts[2]}.{rest}"
        return super().map_weight(name)
