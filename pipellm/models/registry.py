from torch import nn

from pipellm.config import ModelConfig
from pipellm.models.gemma import GemmaStage
from pipellm.models.gpt2 import GPT2Stage
from pipellm.models.llama import LlamaStage
from pipellm.pipeline.partition import StageLayers

STAGE_CLASSES = {
    "LlamaForCausalLM": LlamaStage,
    "MistralForCausalLM": LlamaStage,
    "Qwen2ForCausalLM": LlamaStage,
    "Qwen3ForCausalLM": LlamaStage,
    "Phi3ForCausalLM": LlamaStage,
    "MixtralForCausalLM": LlamaStage,
    "Qwen3MoeForCausalLM": LlamaStage,
    "Gemma2ForCausalLM": GemmaStage,
    "Gemma3ForCausalLM": GemmaStage,
    "GPT2LMHeadModel": GPT2Stage,
}


def build_stage_model(cfg: ModelConfig, stage: StageLayers) -> nn.Module:
    return STAGE_CLASSES[cfg.architecture](cfg, stage)
