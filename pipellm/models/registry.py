import contextlib

import torch
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.afmoe import AfmoeStage
from pipellm.models.apertus import ApertusStage
from pipellm.models.classic import NemotronStage, NeoXStage, PhiStage, StableLmStage, Starcoder2Stage
from pipellm.models.cohere import CohereStage
from pipellm.models.falcon_h1 import FalconH1Stage
from pipellm.models.jamba import JambaStage
from pipellm.models.lfm2 import Lfm2Stage
from pipellm.models.deepseek import DeepseekStage, BiasedRouterStage, GatedAttentionStage
from pipellm.models.gemma import Gemma1Stage, Gemma4Stage, GemmaStage, VaultGemmaStage
from pipellm.models.glm import Ernie45MoeStage, Glm4Stage, HeliumStage, InterleavedRotaryStage
from pipellm.models.gpt2 import GPT2Stage
from pipellm.models.gpt_oss import GptOssStage
from pipellm.models.granite import BambaStage, GraniteHybridStage, GraniteMoeStage
from pipellm.models.hunyuan import HunyuanStage
from pipellm.models.llama import LlamaStage
from pipellm.models.llama4 import Llama4Stage
from pipellm.models.nemotron_h import NemotronHStage
from pipellm.models.olmo import Olmo2Stage, OlmoStage
from pipellm.models.phimoe import PhimoeStage
from pipellm.models.qwen3_next import Qwen3NextStage
from pipellm.pipeline.partition import StageLayers

STAGE_CLASSES = {
    "LlamaForCausalLM": LlamaStage,
    "MistralForCausalLM": LlamaStage,
    "Qwen2ForCausalLM": LlamaStage,
    "Qwen3ForCausalLM": LlamaStage,
    "Phi3ForCausalLM": LlamaStage,
    "SmolLM3ForCausalLM": LlamaStage,
    "GraniteForCausalLM": LlamaStage,
    "Olmo2ForCausalLM": Olmo2Stage,
    "Olmo3ForCausalLM": Olmo2Stage,
    "FlexOlmoForCausalLM": Olmo2Stage,
    "Exaone4ForCausalLM": OlmoStage,
    "SeedOssForCausalLM": LlamaStage,
    "MinistralForCausalLM": LlamaStage,
    "Ministral3ForCausalLM": LlamaStage,
    "Llama4ForCausalLM": Llama4Stage,
    "Glm4ForCausalLM": Glm4Stage,
    "Ernie4_5ForCausalLM": InterleavedRotaryStage,
    "Ernie4_5_MoeForCausalLM": Ernie45MoeStage,
    "CohereForCausalLM": CohereStage,
    "Cohere2ForCausalLM": CohereStage,
    "Cohere2MoeForCausalLM": CohereStage,
    "AfmoeForCausalLM": AfmoeStage,
    "HunYuanDenseV1ForCausalLM": HunyuanStage,
    "HunYuanMoEV1ForCausalLM": HunyuanStage,
    "GraniteMoeForCausalLM": GraniteMoeStage,
    "GraniteMoeSharedForCausalLM": GraniteMoeStage,
    "GraniteSWAForCausalLM": LlamaStage,
    "GraniteMoeSWAForCausalLM": GraniteMoeStage,
    "GraniteMoeHybridForCausalLM": GraniteHybridStage,
    "OlmoeForCausalLM": LlamaStage,
    "ArceeForCausalLM": LlamaStage,
    "ApertusForCausalLM": ApertusStage,
    "MixtralForCausalLM": LlamaStage,
    "PhimoeForCausalLM": PhimoeStage,
    "Qwen3MoeForCausalLM": LlamaStage,
    "Qwen2MoeForCausalLM": LlamaStage,
    "GptOssForCausalLM": GptOssStage,
    "DeepseekV2ForCausalLM": DeepseekStage,
    "DeepseekV3ForCausalLM": DeepseekStage,
    "Glm4MoeLiteForCausalLM": DeepseekStage,
    "Mistral4ForCausalLM": DeepseekStage,
    "YoutuForCausalLM": DeepseekStage,
    "MiniCPM3ForCausalLM": DeepseekStage,
    "Glm4MoeForCausalLM": BiasedRouterStage,
    "SolarOpenForCausalLM": BiasedRouterStage,
    "ExaoneMoeForCausalLM": BiasedRouterStage,
    "MiniCPM5MoeForCausalLM": GatedAttentionStage,
    "Dots1ForCausalLM": BiasedRouterStage,
    "MiniMaxM2ForCausalLM": BiasedRouterStage,
    "GemmaForCausalLM": Gemma1Stage,
    "Gemma2ForCausalLM": GemmaStage,
    "Gemma3ForCausalLM": GemmaStage,
    "Gemma4ForCausalLM": Gemma4Stage,
    "GPT2LMHeadModel": GPT2Stage,
    "Qwen3NextForCausalLM": Qwen3NextStage,
    "Qwen3_5ForCausalLM": Qwen3NextStage,
    "Qwen3_5MoeForCausalLM": Qwen3NextStage,
    "NemotronHForCausalLM": NemotronHStage,
    "FalconH1ForCausalLM": FalconH1Stage,
    "JambaForCausalLM": JambaStage,
    "Lfm2ForCausalLM": Lfm2Stage,
    "BambaForCausalLM": BambaStage,
    "Lfm2MoeForCausalLM": Lfm2Stage,
    "GPTNeoXForCausalLM": NeoXStage,
    "PhiForCausalLM": PhiStage,
    "Starcoder2ForCausalLM": Starcoder2Stage,
    "NemotronForCausalLM": NemotronStage,
    "StableLmForCausalLM": StableLmStage,
    "HeliumForCausalLM": HeliumStage,
    "VaultGemmaForCausalLM": VaultGemmaStage,
}


# what modules' reset_parameters call; on the meta device they compute nothing
INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "constant_", "trunc_normal_")


def build_stage_model(cfg: ModelConfig, stage: StageLayers, meta: bool = False) -> nn.Module:
    """The stage's modules, randomly initialised; with meta, on the meta device (no memory: the loader fills them)."""
    if not meta:
        return STAGE_CLASSES[cfg.architecture](cfg, stage)
    with torch.device("meta"), _without_init():
        return STAGE_CLASSES[cfg.architecture](cfg, stage)


@contextlib.contextmanager
def _without_init():
    """torch.nn.init's functions as no-ops (as transformers' no_init_weights does): the first one run on a meta
    tensor imports torch's symbolic-shape machinery, ~800 modules with sympy, 68 MB of the process."""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    try:
        for name in INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
