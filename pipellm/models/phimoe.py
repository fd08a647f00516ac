"""Phi-MoE (Phi-3.5-MoE): Mixtral's layers and names (moe.py's experts, two a token picked by sparsemixer), with
LayerNorms that have biases, attention with biases, and an LM head with a bias."""
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.llama import LlamaStage
from pipellm.pipeline.partition import StageLayers


class PhimoeStage(LlamaStage):
    norm_class = nn.LayerNorm  # (size, eps), with a bias

    def __init__(self, cfg: ModelConfig, stage: StageLayers):
        super().__init__(cfg, stage)
        if stage.is_last and cfg.lm_head_bias:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        if name in ("model.norm.bias", "lm_head.bias"):
            return [(name.removeprefix("model."), 0)] if self.stage.is_last else []
        return super().map_weight(name)
