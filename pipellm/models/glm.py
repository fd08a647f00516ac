"""Rotary pairs interleaved, (2i, 2i+1), as GLM-4's and ERNIE 4.5's checkpoints hold them: the q/k rows of the rotated
part are reordered at load so that the pairs become (i, i + half), the layout the rotary kernels turn. Scores are dot
products of q and k, which one reordering of both leaves as they were.

GLM-4 (Glm4ForCausalLM): Gemma's layer order (norms after attention and MLP too) with plain RMSNorms, biases on q, k
and v, and rotary on half of each head. ERNIE 4.5 (Ernie4_5ForCausalLM): Llama's block, rotary on all of each head,
and with use_bias a bias on every linear layer; its MoE (Ernie4_5_MoeForCausalLM) names its shared experts and its
router's selection bias (moe.py) its own way. Helium (HeliumForCausalLM): Llama's block, rotary on all of each head,
OLMo's norms (scaled in fp32), biases on q, k and v with attention_bias."""
import re

import torch

from pipellm.models.gemma import GemmaLayer
from pipellm.models.layers import Fp32ScaledRMSNorm
from pipellm.models.llama import LlamaStage

# GLM-4's norm names -> GemmaLayer's: after attention, before the MLP, after it
NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
         "post_attention_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}
NORM_NAME = re.compile(rf"\.({'|'.join(NORMS)})\.")
QK = re.compile(r"\.self_attn\.(q|k)_proj\.(weight|bias)$")


class InterleavedRotaryStage(LlamaStage):
    def row_order(self, name: str) -> torch.Tensor | None:
        """The rows of a checkpoint's tensor in this stage's layout (q's and k's reordered), or None: as they are."""
        if not (m := QK.search(name)):
            return None
        cfg = self.cfg
        heads, rotated = cfg.num_heads if m[1] == "q" else cfg.num_kv_heads, self.rotary.rotated_dim
        order = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2),
                           torch.arange(rotated, cfg.head_dim)])                        # [D] within a head
        return (torch.arange(heads)[:, None] * cfg.head_dim + order).flatten()         # [heads * D]


class Glm4Stage(InterleavedRotaryStage):
    layer_class = GemmaLayer  # with LlamaStage's RMSNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(NORM_NAME.sub(lambda m: f".{NORMS[m[1]]}.", name))


class Ernie45MoeStage(InterleavedRotaryStage):
    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
                                  .replace(".mlp.moe_statics.e_score_correction_bias", ".mlp.selection_bias"))

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".e_score_correction_bias"):
            return tensor.reshape(-1)                                                   # [1, E] -> [E]
        return super().to_param_layout(name, tensor)


class HeliumStage(InterleavedRotaryStage):
    norm_class = Fp32ScaledRMSNorm
