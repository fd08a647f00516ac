"""Phi-MoE (Phi-3.5-MoE): Mixtral's layers and names (moe.py's experts, two a token picked by sparsemixer), with
LayerNorms that have biases, attention with biases, and an LM head with a bias."""
from torch import nn

from pipellm.models.llama import LlamaStage


class PhimoeStage(LlamaStage):
    norm_class = nn.LayerNorm  # (size, eps), with a bias; LlamaStage gives the LM head its bias (lm_head_bias)
