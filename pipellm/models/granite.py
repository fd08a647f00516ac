"""Granite MoE (GraniteMoeForCausalLM, and GraniteMoeSharedForCausalLM with a shared expert every token takes):
Granite's scaled embedding, residual branches, attention and logits (llama.py) with a mixture of experts whose router
softmaxes its top-k logits (moe.py). The checkpoint stacks a layer's experts: input_linear [experts, 2 * width,
hidden] (each expert's gate rows, then its up rows) and output_linear [experts, hidden, width]; at load each expert's
slice fills its own layers."""
from pipellm.models.llama import LAYER_NAME, LlamaStage

STACKED = {"block_sparse_moe.input_linear.weight": "gate_up_proj", "block_sparse_moe.output_linear.weight": "down_proj"}


class GraniteMoeStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple]:
        m = LAYER_NAME.match(name)
        if not m or m[2] not in STACKED:
            return super().map_weight(name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
                                      .replace(".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj.")
                                      .replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))
        layer = int(m[1])
        if not self.stage.start <= layer < self.stage.end:
            return []
        return [(f"layers.{layer - self.stage.start}.mlp.experts.{e}.{STACKED[m[2]]}.weight", 0, e)
                for e in range(self.cfg.num_experts)]
