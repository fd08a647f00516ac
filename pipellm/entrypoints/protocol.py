"""The OpenAI API's shapes: request bodies (validated, with errors in OpenAI's form), their sampling parameters, and
the log-probabilities of responses."""
import re

from pydantic import BaseModel, ConfigDict, ValidationError

from pipellm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

MAX_N = 128                 # completions per prompt


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": type_, "param": param, "code": code}}
        self.headers = headers


# strict: a JSON true is a bool, and "yes", 1.5 or [true] are refused rather than read as True, 1 or token id 1
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None                   # vLLM's extra parameters, beside OpenAI's
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None      # token id (a string, as JSON keys are) -> bias
    response_format: dict | None = None             # OpenAI's: {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: dict | None = None          # vLLM's: {"json" | "regex" | "choice" | "grammar": ...}
    use_beam_search: bool | None = None             # vLLM's: n beams, the n best back (pipellm/beam_search.py)
    priority: int | None = None                     # vLLM's, with --scheduling-policy priority: lower runs first
    length_penalty: float | None = None             # the beams' ranking: cum_logprob / length ** length_penalty


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None     # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None          # a tool message's answer to one of them
    name: str | None = None
    reasoning_content: str | None = None     # an assistant's thought, as this server returned it


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template options: the assistant's turn opened (or the last message continued), and variables
    for the template (Qwen3's enable_thinking, ...)."""
    model_config = STRICT
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class ChatRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter (--allow-runtime-lora-updating)."""
    model_config = STRICT
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the adapter of that name, if one is loaded


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name says which


def parse_request(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{loc}: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None) from None


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
    def get(name, default):  # the request's value, else the model's default (generation_config.json), else ours
        value = getattr(req, name)
        return (defaults or {}).get(name, default) if value is None else value

    bias = None
    if req.logit_bias:
        try:
            bias = {int(t): b for t, b in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias: its keys must be token ids, such as {\"50256\": -100}",
                           param="logit_bias") from None
    structured_outputs = _structured_outputs(req)
    if get("n", 1) > MAX_N:
        raise APIError(400, f"n={req.n}: at most {MAX_N} completions per prompt", param="n")
    try:
        return SamplingParams(n=get("n", 1), max_tokens=max_tokens, temperature=get("temperature", 1.0),
                              top_p=get("top_p", 1.0), top_k=get("top_k", -1), min_p=get("min_p", 0.0),
                              seed=req.seed, stop=req.stop, ignore_eos=get("ignore_eos", False),
                              min_tokens=get("min_tokens", 0), stop_token_ids=req.stop_token_ids, logit_bias=bias,
                              include_stop_str_in_output=get("include_stop_str_in_output", False),
                              structured_outputs=structured_outputs, allowed_token_ids=req.allowed_token_ids,
                              bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens,
                              repetition_penalty=get("repetition_penalty", 1.0),
                              presence_penalty=get("presence_penalty", 0.0),
                              frequency_penalty=get("frequency_penalty", 0.0), logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, skip_special_tokens=get("skip_special_tokens", True))
    except ValueError as e:  # "SamplingParams.<field>=<value>: <why>"
        field = re.match(r"SamplingParams\.(\w+)=", str(e))
        raise APIError(400, str(e), param=field and field.group(1)) from None


# What a beam search does not use: refused (not ignored) unless left out or neutral. Beams rank by log-probability.
_BEAM_SEARCH_NEUTRAL = {"top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
                        "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,), "stop": ("", []),
                        "stop_token_ids": ([],), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],),
                        "response_format": ({"type": "text"},), "structured_outputs": (), "echo": (False,),
                        "tools": ([],)}


def beam_search_params(req: SamplingFields, params: SamplingParams, max_model_len: int) -> BeamSearchParams | None:
    """vLLM's use_beam_search: n beams, with the request's max_tokens, temperature and ignore_eos (params: the
    request's SamplingParams, defaults applied). None for a request that samples."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1):
            raise APIError(400, "length_penalty ranks a beam search's beams: give use_beam_search=true with it, or "
                           "leave it out", param="length_penalty")
        return None
    for name, neutral in _BEAM_SEARCH_NEUTRAL.items():
        value = getattr(req, name, None)
        # a bool is neutral only as itself: completions' logprobs=0 asks for the chosen token's
        if value is not None and not any(value == n and isinstance(value, bool) == isinstance(n, bool)
                                         for n in neutral):
            raise APIError(400, f"use_beam_search ranks beams by their log-probability alone and takes no {name} "
                           f"(here {value!r}): leave it out, or drop use_beam_search to sample", param=name)
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or max_model_len,
                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt, spec = req.response_format, req.structured_outputs
    if fmt is not None and spec is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
    if spec is not None:
        try:
            return StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:  # an unknown key, or not exactly one kind
            raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
    if fmt.get("type") == "json_schema" and isinstance(schema, dict):
        return StructuredOutputsParams(json=schema)
    raise APIError(400, 'response_format: give {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"json_schema": {"name": ..., "schema": {...}}}', param="response_format")


def usage(prompts: list[list[int]], num_completion_tokens: int) -> dict:
    num_prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt + num_completion_tokens}


def _token_str(lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


class CompletionLogprobs:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (running over chunks).
    An entry of None (the first prompt token, echoed: nothing before it) has null log-probabilities."""

    def __init__(self, decode):
        self.offset, self.decode = 0, decode

    def format(self, token_ids: list[int], entries: list[dict | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, entries):
            token = self.decode(tid) if entry is None else _token_str(entry[tid])
            out["tokens"].append(token)
            out["token_logprobs"].append(None if entry is None else entry[tid].logprob)
            # The top k, plus the sampled token when it is not among them (as OpenAI and vLLM do).
            out["top_logprobs"].append(None if entry is None else {
                _token_str(lp): lp.logprob for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out


def chat_logprobs(token_ids: list[int], entries: list[dict], top_k: int) -> dict:
    def item(lp) -> dict:
        token = _token_str(lp)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for tid, entry in zip(token_ids, entries):
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append(item(entry[tid]) | {"top_logprobs": [item(lp) for lp in top]})
    return {"content": content}
