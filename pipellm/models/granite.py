"""Granite MoE (GraniteMoeForCausalLM, and GraniteMoeSharedForCausalLM with a shared expert every token takes):
Granite's scaled embedding, residual branches, attention and logits (llama.py) with a mixture of experts whose router
softmaxes its top-k logits (moe.py). The checkpoint stacks a layer's experts: input_linear [experts, 2 * width,
hidden] (each expert's gate rows, then its up rows) and output_linear [experts, hidden, width]; at load each expert's
slice fills its own layers, as transformers 5's stacked experts (llama.py). Granite 4.0-H
(GraniteMoeHybridForCausalLM) is Granite MoE Shared with Mamba-2 mixers (linear_attention.py) in most layers' place of
attention, and no rotary in the others; its dense models have the shared MLP alone. Bamba (BambaForCausalLM) has
the same Mamba-2 layers among Llama's attention ones (rotary on half of each head) and Llama's MLPs, under
Jamba's names."""
from pipellm.models.linear_attention import Mamba2Mixer
from pipellm.models.llama import LlamaStage, StateLayer, feed_forward_names


class GraniteMoeStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(name.replace(".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj")
                                  .replace(".block_sparse_moe.experts.", ".mlp.experts.")  # Granite MoE SWA's
                                  .replace(".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj")
                                  .replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
                                  .replace(".block_sparse_moe.router.", ".mlp.gate.")
                                  .replace(".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj.")
                                  .replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))


class GraniteHybridLayer(StateLayer):
    mixer_name, mixer_class = "mamba", Mamba2Mixer


class GraniteHybridStage(GraniteMoeStage):
    layer_class = GraniteHybridLayer

    def map_weight(self, name: str) -> list[tuple]:
        if not self.cfg.num_experts:  # a dense model's MLP: the shared one
            name = name.replace(".shared_mlp.input_linear.", ".mlp.gate_up_proj.").replace(
                ".shared_mlp.output_linear.", ".mlp.down_proj.")
        return super().map_weight(name)


class BambaStage(LlamaStage):
    layer_class = GraniteHybridLayer

    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(feed_forward_names(name))
