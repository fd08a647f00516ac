from dataclasses import dataclass

from pipellm.lora import LoRARequest


@dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None    # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: token id -> Logprob
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float                 # time.monotonic() clock
    token_times: list[float]            # when each output token of the first completion arrived

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token; None for the first
    lora_request: LoRARequest | None = None  # the adapter it ran with (pipellm.lora), as vLLM's
