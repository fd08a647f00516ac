"""Granite MoE (GraniteMoeForCausalLM, and GraniteMoeSharedForCausalLM with a shared expert every token takes):
Granite's scaled embedding, residual branches, attention and logits (llama.py) with a mixture of experts whose router
softmaxes its top-k logits (moe.py). The checkpoint stacks a layer's experts: input_linear [experts, 2 * width,
hidden] (each expert's gate rows, then its up rows) and output_linear [experts, hidden, width]; at load each expert's
slice fills its own layers, as transformers 5's stacked experts (llama.py)."""
from pipellm.models.llama import LlamaStage


class GraniteMoeStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple]:
        return super().map_weight(name.replace(".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj")
                                  .replace(".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj")
                                  .replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
                                  .replace(".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj.")
                                  .replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))
