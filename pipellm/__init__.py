"""pipellm: pipeline-parallel LLM inference."""
from pipellm.llm import LLM
from pipellm.lora import LoRARequest
from pipellm.outputs import CompletionOutput, RequestOutput
from pipellm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"
