"""Jamba (JambaForCausalLM): Llama's blocks without rotary, Mamba mixers (linear_attention.py) in place of attention
in all but every 8th layer, and Mixtral's experts (a softmax's top 2, weighed as they are) in every other layer."""
from pipellm.models.linear_attention import Mamba1Mixer
from pipellm.models.llama import LlamaStage, StateLayer, feed_forward_names


class JambaLayer(StateLayer):
    mixer_name, mixer_class = "mamba", Mamba1Mixer


class JambaStage(LlamaStage):
    layer_class = JambaLayer

    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(feed_forward_names(name))
