"""Jamba (JambaForCausalLM): Llama's blocks without rotary, Mamba mixers (linear_attention.py) in place of attention
in all but every 8th layer, and Mixtral's experts (a softmax's top 2, weighed as they are) in every other layer."""
from pipellm.models.linear_attention import Mamba1Mixer
from pipellm.models.llama import LlamaStage, StateLayer


class JambaLayer(StateLayer):
    mixer_name, mixer_class = "mamba", Mamba1Mixer


class JambaStage(LlamaStage):
    layer_class = JambaLayer

    def map_weight(self, name: str) -> list[tuple]:
        """Its checkpoints' names as Llama's: feed_forward the MLP (router its gate), pre_ff_layernorm its norm."""
        return super().map_weight(name.replace(".feed_forward.router.", ".mlp.gate.").replace(
            ".feed_forward.", ".mlp.").replace(".pre_ff_layernorm.", ".post_attention_layernorm.").replace(
            "model.final_layernorm.", "model.norm."))
