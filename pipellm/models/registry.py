from torch import nn

from pipellm.config import ModelConfig
from pipellm.models.gpt2 import GPT2Stage
from pipellm.models.llama import LlamaStage
from pipellm.pipeline.partition import StageLayers

STAGE_CLASSES = {
    "LlamaForCausalLM": LlamaStage,
    "MistralForCausalLM": LlamaStage,
    "Qwen2ForCausalLM": LlamaStage,
    "GPT2LMHeadModel": GPT2Stage,
}


def build_stage_model(cfg: ModelConfig, stage: StageLayers) -> nn.Module:
    return STAGE_CLASSES[cfg.architecture](cfg, stage)
