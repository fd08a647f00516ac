"""LFM2 (Lfm2ForCausalLM): Llama's blocks, most with a gated short convolution (linear_attention.py's ShortConv, a
state of its last few inputs per sequence) in place of attention; the attention layers' q and k RMS-normed per head,
as Qwen3's. LFM2-MoE (Lfm2MoeForCausalLM) has experts (moe.py) in all but its first layers, picked by sigmoid scores
plus expert_bias. Its checkpoints' names as Llama's."""
import torch

from pipellm.models.linear_attention import ShortConv
from pipellm.models.llama import LlamaStage, StateLayer

RENAMES = ((".conv.conv.", ".conv.conv1d."), (".operator_norm.", ".input_layernorm."),
           (".ffn_norm.", ".post_attention_layernorm."), (".feed_forward.w1.", ".mlp.gate_proj."),
           (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
           (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
           (".self_attn.out_proj.", ".self_attn.o_proj."), ("model.embedding_norm.", "model.norm."),
           (".feed_forward.expert_bias", ".mlp.selection_bias"), (".feed_forward.", ".mlp."))  # LFM2-MoE's


class Lfm2Layer(StateLayer):
    mixer_name, mixer_class = "conv", ShortConv


class Lfm2Stage(LlamaStage):
    layer_class = Lfm2Layer

    def map_weight(self, name: str) -> list[tuple]:
        for old, new in RENAMES:
            name = name.replace(old, new)
        return super().map_weight(name)

    def to_param_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".conv.conv.weight"):  # HF's [C, 1, taps]
            return tensor.reshape(tensor.shape[0], -1)
        return super().to_param_layout(name, tensor)
