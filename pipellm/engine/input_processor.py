"""The driver's input side: prompts tokenized and checked against the model and the engine's limits before anything
is queued (a bad one raises ValueError and changes nothing), and what the sampler needs of a request's parameters
as token ids."""
from pipellm import structured
from pipellm.model_config import ModelConfig
from pipellm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, model_config: ModelConfig, model_dir: str, max_model_len: int,
                 eos_token_ids: set[int], max_logprobs: int, scheduling_policy: str = "fcfs"):
        self.tokenizer, self.model_config, self.model_dir = tokenizer, model_config, model_dir
        self.max_model_len, self.eos_token_ids, self.max_logprobs = max_model_len, eos_token_ids, max_logprobs
        self.scheduling_policy = scheduling_policy
        self._structured_tokenizer = None  # llguidance's, made on the first request with structured outputs
        self._grammars_checked: set[tuple[str, str]] = set()  # (kind, text) that compiled, for prompts that share one

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"the model at {self.model_dir} has no tokenizer; pass {{'prompt_token_ids': [...]}}")
        return self.tokenizer.encode(prompt)

    @staticmethod
    def truncated(prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as it runs: its last params.truncate_prompt_tokens tokens, when that is set."""
        k = params.truncate_prompt_tokens
        return list(prompt_token_ids[-k:]) if k else prompt_token_ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        prompt_token_ids = self.truncated(prompt_token_ids, params)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}); these are not: {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (prompt plus at least one new token); shorten the prompt")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= vocab]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids outside [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} asks for more than the vocabulary's "
                                 f"{vocab} tokens; ask for {vocab} at most")
            if self.max_logprobs >= 0 and (getattr(params, name) or 0) > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is over the engine's max_logprobs="
                                 f"{self.max_logprobs}; ask for fewer, or start the engine with a larger "
                                 "max_logprobs (--max-logprobs; -1: no cap)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words needs a tokenizer, and the model at {self.model_dir} has none")
        self.check_structured(params)

    def check_structured(self, params: SamplingParams) -> None:
        """Compiles params' grammar (once per grammar): a bad one is refused here, before a stage compiles it."""
        spec = params.structured_outputs
        if spec is not None and spec.kind not in self._grammars_checked:
            structured.grammar(spec, self.structured_tokenizer)
            if len(self._grammars_checked) >= 1024:
                self._grammars_checked.clear()
            self._grammars_checked.add(spec.kind)

    def check_priority(self, priority) -> None:
        if type(priority) is not int:
            raise ValueError(f"priority={priority!r}: must be an integer (lower runs first)")
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority}: this engine runs requests first come, first served; start it "
                             "with scheduling_policy=\"priority\" (--scheduling-policy priority) to order them")

    @property
    def structured_tokenizer(self):
        if self._structured_tokenizer is None:
            self._structured_tokenizer = structured.ll_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                                 self.model_dir)
        return self._structured_tokenizer

    def min_tokens_stop_ids(self, params: SamplingParams) -> list[int]:
        """The tokens the sampler keeps out before params.min_tokens: EOS and the stop tokens. EOS under ignore_eos
        too, as vLLM and HF's min_new_tokens: ignore_eos decides whether it ends the output, not when it may come."""
        if not params.min_tokens:
            return []
        return sorted(t for t in self.eos_token_ids | set(params.stop_token_ids) if t < self.model_config.vocab_size)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, at the start of a text and after a space (as vLLM), each token sequence once."""
        ids = (self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
               for word in words for prefix in ("", " "))
        return [list(t) for t in dict.fromkeys(tuple(t) for t in ids if t)]
