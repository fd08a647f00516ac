"""OLMo 2 and OLMo 3, EXAONE 4: the Llama block with its norms on the attention's and the MLP's outputs instead of
their inputs. OLMo's q/k norms span all of a token's heads at once (OLMo 3 adds sliding-window layers with rotary of
their own); EXAONE 4's are per head, and its full layers (among sliding ones) take no rotary positions."""
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.layers import Fp32ScaledRMSNorm, RMSNorm
from pipellm.models.llama import LlamaAttention, LlamaStage, make_mlp


class OlmoLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = make_mlp(cfg, layer)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, ropes, meta, cache):
        x = x + self.post_attention_layernorm(self.self_attn(x, ropes, meta, cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class OlmoStage(LlamaStage):
    layer_class = OlmoLayer  # EXAONE 4: with Llama's RMSNorm


class Olmo2Stage(OlmoStage):
    norm_class = Fp32ScaledRMSNorm
