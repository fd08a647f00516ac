"""Apertus (ApertusForCausalLM): Llama's block with q/k norms, an ungated MLP through xIELU (layers.XieluMLP), and
its own names for the two norms."""
import torch

from pipellm.family_config import renamed
from pipellm.models.llama import LlamaStage

NORMS = ((".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm."))


class ApertusStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(renamed(name, NORMS))

    @staticmethod
    def to_param_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(1) if tensor.dim() == 0 else tensor  # xIELU's beta and eps: scalars, held as [1]
