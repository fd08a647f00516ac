"""Llama 4 (Llama4ForCausalLM, and the text model of Llama4ForConditionalGeneration: Scout, Maverick): Llama's block
where every 4th layer has no rotary and attends to the whole context, its queries scaled up with the position
(nope_temperature), and the others attend within chunks of attention_chunk_size positions (attention.py), q and k
RMS-normed without weights after their rotary; a mixture of experts (moe.py) whose router's sigmoid weighs the one
chosen expert's input, beside a shared expert, in every layer or every other one (Maverick), the rest dense. The
rotary pairs are (2i, 2i+1): q's and k's rows are reordered at load (glm.py). The checkpoint stacks a layer's
experts as [experts, in, out] (llama.py's experts_in_out): each expert's slice becomes its nn.Linear's rows."""
from pipellm.models.glm import InterleavedRotaryStage


class Llama4Stage(InterleavedRotaryStage):
    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(name.replace(".feed_forward.router.", ".mlp.gate.")
                                  .replace(".feed_forward.", ".mlp.")
                                  .replace(".mlp.shared_experts.", ".mlp.shared_expert."))  # GGUF's, as DeepSeek's
