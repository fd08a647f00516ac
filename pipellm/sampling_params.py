import json
import math
import numbers
from dataclasses import dataclass

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """The shape the output must take (vLLM's structured outputs): give exactly one."""
    json: str | None = None              # a JSON schema (a dict is kept as its JSON text)
    regex: str | None = None             # a regular expression the whole output matches
    choice: list[str] | None = None      # the output is one of these strings
    grammar: str | None = None           # a Lark or GBNF (llama.cpp) grammar
    json_object: bool = False            # any JSON object

    def __post_init__(self):
        if type(self.json_object) is not bool:
            raise ValueError(f"SamplingParams.structured_outputs.json_object={self.json_object!r}: must be True or "
                             "False")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs: give exactly one of {', '.join(_STRUCTURED_KINDS)}"
                             f"{' (got ' + ', '.join(given) + ')' if given else ''}")
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"SamplingParams.structured_outputs.{name}: must be a string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice: must be a list of non-empty strings")

    @property
    def kind(self) -> tuple[str, str]:
        """(kind, its grammar text): json_object as the schema of any object, choice as a JSON list."""
        if self.json_object:
            return "json_object", '{"type": "object"}'
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return next((k, getattr(self, k)) for k in ("json", "regex", "grammar") if getattr(self, k) is not None)


def _as_list(value):
    return [] if value is None else list(value) if isinstance(value, tuple) else value


@dataclass
class SamplingParams:
    n: int = 1                          # completions per prompt
    max_tokens: int | None = 16         # new tokens at most; None = up to max_model_len
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # nucleus mass kept, in (0, 1]
    top_k: int = -1                     # keep the k most likely tokens; -1 (or 0) = all
    min_p: float = 0.0                  # drop tokens below min_p * p(top token)
    seed: int | None = None             # per-request seed; same seed, same output
    stop: str | list[str] | None = None         # stop strings, not included in the output
    stop_token_ids: list[int] | None = None     # extra stop tokens besides EOS
    include_stop_str_in_output: bool = False    # keep the stop string that ended the output in its text
    ignore_eos: bool = False            # keep going past EOS
    min_tokens: int = 0                 # new tokens before EOS, a stop token or a stop string may end the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn
    bad_words: list[str] | None = None  # words never generated (as the tokenizer encodes each, with and without
    #                                     a leading space)
    repetition_penalty: float = 1.0     # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0       # subtracted once from every token already generated
    frequency_penalty: float = 0.0      # subtracted per occurrence in the generated tokens
    logprobs: int | None = None         # top-k log-probabilities returned per generated token
    prompt_logprobs: int | None = None  # top-k log-probabilities returned per prompt token (after the first)
    skip_special_tokens: bool = True    # drop special tokens from the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (left truncation)
    structured_outputs: StructuredOutputsParams | None = None  # hold the output to a schema, regex or grammar

    def __post_init__(self):
        # a string, a tuple or None as the list they mean; anything else is left for _check to name
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {t: float(b) if type(b) is int else b for t, b in self.logit_bias.items()}
        self._check()

    def _check(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        # the stages check these types too (pipeline/wire.py): a value that passed here and failed there would end
        # the pipeline, so a truthy "no" or a bool counted as 1 is refused here
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                bad(name, "must be a finite number")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if type(getattr(self, name)) is not bool:
                bad(name, "must be True or False")
        for name in ("n", "max_tokens", "top_k", "logprobs", "prompt_logprobs", "seed", "min_tokens",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))  # numpy's integers as Python's
            elif value is not None or name in ("n", "top_k", "min_tokens"):
                bad(name, "must be an integer" + ("" if name in ("n", "top_k", "min_tokens") else " or None"))
        if self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if not -1 <= self.top_k < 2 ** 31:
            bad("top_k", "must be -1 (all tokens) or a positive integer below 2**31")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        # Further out, dividing float32 logits by it overflows to inf and no token can be drawn.
        if not 0.01 <= self.repetition_penalty <= 100.0:
            bad("repetition_penalty", "must be in [0.01, 100] (1 means none)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be None or an integer >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be None or an integer >= 0")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            bad("seed", "must be an integer in [0, 2**63), or None for a random one")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(type(t) is not int or t < 0
                                                            for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(type(t) is not int or t < 0 for t in self.logit_bias)
                or any(type(b) is not float or not -100.0 <= b <= 100.0 for b in self.logit_bias.values())):
            bad("logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(type(t) is not int or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be None or a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", "must be None or a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            bad("truncate_prompt_tokens", "must be None or an integer >= 1")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            if self.min_tokens:
                bad("min_tokens", "must be 0 with structured_outputs: the grammar decides where the output ends")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters, as vLLM's (pipellm/beam_search.py)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # of the step's pick, which joins its top log-probabilities (those are of raw logits)
    length_penalty: float = 1.0

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"BeamSearchParams.{name}={getattr(self, name)!r}: {why}")

        for name in ("beam_width", "max_tokens"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if type(self.ignore_eos) is not bool:
            bad("ignore_eos", "must be True or False")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be a number >= 0")
