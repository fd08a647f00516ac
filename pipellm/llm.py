"""The offline API: LLM(...).generate(prompts) and LLM(...).chat(messages), as in vLLM."""
import contextlib
import difflib
import itertools
import numbers
import os
import weakref
from collections.abc import Iterator

from tqdm import tqdm

from pipellm import chat
from pipellm.beam_search import BeamSearchOutput, beam_search
from pipellm.config import EngineConfig, generation_defaults
from pipellm.engine.detokenizer import StreamText
from pipellm.engine.engine import LLMEngine
from pipellm.lora import LoRARequest
from pipellm.outputs import RequestOutput
from pipellm.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict

_LOCAL_ONLY = "pipellm loads local folders and GGUF files, with no hub download: give model a local path"
# vLLM's options that pipellm has no field for: (values that ask for what pipellm does anyway, what to give instead)
_VLLM_ONLY = {
    "tensor_parallel_size": ((1,), "pipellm splits a model by layers, into pipeline stages: give "
                                   "pipeline_parallel_size (-pp) instead"),
    "trust_remote_code": ((True, False), "give True or False: pipellm runs no code from a checkpoint either way"),
    "enable_chunked_prefill": ((True, None), "pipellm always runs a prompt in chunks of max_num_batched_tokens: "
                                             "give a larger max_num_batched_tokens for fewer, longer chunks"),
    "tokenizer": ((None,), "pipellm reads the tokenizer from the model's folder (tokenizer.json) or its GGUF file"),
    "revision": ((None,), _LOCAL_ONLY), "tokenizer_revision": ((None,), _LOCAL_ONLY),
    "download_dir": ((None,), _LOCAL_ONLY),
}


def engine_options(kwargs: dict) -> dict:
    """kwargs without the vLLM options that ask for what pipellm does anyway; ValueError naming any other option
    that EngineConfig does not have, with what to give instead."""
    fields = EngineConfig.__dataclass_fields__
    out = {}
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name == "kv_cache_memory_bytes":  # vLLM's unit, as the CLI's flag
            if "kv_cache_gib" in kwargs:
                raise ValueError("give kv_cache_gib or kv_cache_memory_bytes, not both")
            if type(value) is not int or value <= 0:
                raise ValueError(f"kv_cache_memory_bytes={value!r}: must be a positive integer")
            out["kv_cache_gib"] = value / 2 ** 30
        elif name in _VLLM_ONLY:
            fine, instead = _VLLM_ONLY[name]
            if not any(value is f or type(value) is type(f) and value == f for f in fine):
                raise ValueError(f"{name}={value!r}: {instead}")
        else:
            close = difflib.get_close_matches(name, fields, n=3)
            raise ValueError(f"LLM has no option {name!r}; " + (f"did you mean {' or '.join(close)}?" if close else
                             f"its options are {', '.join(sorted(fields))}"))
    return out


class LLM:
    def __init__(self, model: str | None = None, pipeline_parallel_size: int = 1,
                 layer_partition: list[int] | str | None = None, dtype: str = "auto", block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 64, seed: int = 0,
                 threads_per_stage: int | None = None, trace_dir: str | None = None, **engine_kwargs):
        if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
            raise ValueError(f"trace_dir={trace_dir!r}: must be a folder's path, or None for no trace")
        config = EngineConfig(model, pipeline_parallel_size, layer_partition, dtype, block_size, max_model_len,
                              max_num_seqs, seed=seed, threads_per_stage=threads_per_stage,
                              trace=trace_dir is not None or engine_kwargs.pop("trace", False),
                              **engine_options(engine_kwargs))
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._dead: str | None = None
        # Stage processes end with this object even if the user never calls shutdown().
        self._finalizer = weakref.finalize(self, _close, self.engine, trace_dir)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._finalizer()
        self._dead = self._dead or "this LLM was shut down; create a new LLM"

    def save_trace(self, out_dir: str) -> dict:
        """Writes trace.json, pipeline.png, kv_cache.png and summary.json for what ran since the last save."""
        from pipellm.observe.trace import save_trace
        if self.engine.tracer is None:
            raise ValueError("tracing is off; create the LLM with trace_dir=... to record a trace")
        return save_trace(self.engine, out_dir)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name: llm.llm_engine.add_lora(...), remove_lora(id), list_loras()."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults: those in its generation_config.json, as vLLM's LLM."""
        return SamplingParams(**generation_defaults(self.engine.model_dir))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, as vLLM's: the next prompts run cold. False while requests run."""
        if self._dead:
            raise RuntimeError(self._dead)
        return self.engine.reset_prefix_cache()

    def describe_stages(self) -> list[str]:
        """One line a stage: its layers and its memory, e.g. "stage 0: embed + layers 0-14, 61 MB weights (Q4_1),
        ..."; only the layers while the pipeline cannot answer."""
        if self._dead:
            raise RuntimeError(self._dead)
        reports = self.engine.inspect() if not self.engine.in_flight else []
        if len(reports) != len(self.engine.stages):
            return [s.describe() for s in self.engine.stages]
        return [f"{s.describe()}, {r.describe_memory()}" for s, r in zip(self.engine.stages, reports)]

    def inspect(self, prompt: PromptType) -> dict:
        """Runs the prompt and one generated token through the pipeline, recording every layer: what the final norm
        and LM head make of its output at each prompt position (a logit lens), the generated token's attention over
        each layer's cache, and the cache blocks each layer holds. The data of inspect.json (see README)."""
        from pipellm.engine.inspect import run_probe
        if self._dead:
            raise RuntimeError(self._dead)
        _, ids = self._to_token_ids(prompt)
        return run_probe(self.engine, ids)

    # ---- generation -----------------------------------------------------------------------------------------

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.inputs.tokenize(prompt)
        if isinstance(prompt, dict):
            if other := [k for k in prompt if k not in ("prompt", "prompt_token_ids")]:  # multi_modal_data, ...
                raise ValueError(f"a prompt dict holds 'prompt' and/or 'prompt_token_ids'; pipellm runs text models "
                                 f"and takes no {other}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of token ids")
                # numpy's integers as Python's; anything else is left for validate() to name
                return prompt.get("prompt"), [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                              else t for t in ids]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.engine.inputs.tokenize(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' (a list of token ids) or 'prompt' (a string); "
                             f"this one has {list(prompt)}")
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids' (or 'prompt'), "
                         f"not {type(prompt).__name__}")

    def generate(self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """priority: one a prompt, with scheduling_policy="priority" (lower runs first), as vLLM's. lora_request:
        the LoRA adapter to run every prompt with, or one (or None) a prompt (enable_lora)."""
        if self._dead:
            raise RuntimeError(self._dead)
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        if priority is not None and (not isinstance(priority, list) or len(priority) != len(prompts)):
            raise ValueError(f"priority: give a list of one integer per prompt ({len(prompts)}), not {priority!r}")
        queued = self._queue(prompts, params_list, priority, lora_request)
        with self._running([rid for rid, _ in queued]):
            with tqdm(total=sum(p.n for p in params_list), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    bar.update(sum(r.is_finished for r in self.engine.step()))
            self._drain()
        return [self.engine.pop_output(rid, prompt) for rid, prompt in queued]

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """As vLLM's LLM.beam_search (pipellm/beam_search.py): a BeamSearchOutput per prompt, its best beams first;
        every beam runs with lora_request's adapter if given."""
        if self._dead:
            raise RuntimeError(self._dead)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, not {type(params).__name__}")
        return beam_search(self, [self._to_token_ids(p)[1] for p in _prompt_list(prompts)], params, use_tqdm,
                           lora_request)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """One prompt's completion (n=1) as it is generated: yields the new text of each step. The pieces add up to
        the text generate() gives; a tail that could still become a stop string waits until it cannot."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"stream() yields one completion; got n={params.n}")
        if self._dead:
            raise RuntimeError(self._dead)
        [(rid, text)] = self._queue([prompt], [params], lora_request=lora_request)
        req, shown = self.engine.requests[rid], StreamText(params.stop)
        with self._running([rid]):
            while not req.is_finished:
                self.engine.step()
                stop_text = req.text if isinstance(req.stop_reason, str) else None
                if piece := shown.add(self.engine.outputs.text(req)[len(shown.text):], req.is_finished, stop_text):
                    yield piece
            self._drain()
        self.engine.pop_output(rid, text)

    def _queue(self, prompts: list[PromptType], params_list: list[SamplingParams],
               priority: list[int] | None = None, lora_request=None) -> list[tuple[str, str | None]]:
        """Adds the prompts' requests, every prompt checked before any is added (a bad one leaves the engine
        untouched). Returns (request id, prompt text) each."""
        encoded = [self._to_token_ids(p) for p in prompts]
        priority = priority or [0] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts; give one, or one per prompt")
        for (_, ids), params, p, lora in zip(encoded, params_list, priority, loras):
            self.engine.inputs.validate(ids, params)
            self.engine.inputs.check_priority(p)
            self.engine.check_lora(lora)
        queued = [(f"gen-{next(self._ids)}", text) for text, _ in encoded]
        for (rid, _), (_, ids), params, p, lora in zip(queued, encoded, params_list, priority, loras):
            self.engine.add_request(rid, ids, params, p, lora)
        return queued

    @contextlib.contextmanager
    def _running(self, request_ids: list[str]):
        """Around the steps of these requests: on an error they are aborted; on Ctrl-C (a batch may be half
        received, so the pipeline cannot be trusted) the engine shuts down. A request a restart dropped
        (restart_on_failure) ends with finish_reason "abort"."""
        try:
            yield
            self.engine.dropped.clear()
        except KeyboardInterrupt:
            self._dead = "the engine was shut down by KeyboardInterrupt; create a new LLM"
            self.engine.executor.shutdown(timeout_s=1.0)  # the user is waiting: a second's grace, then stages are killed
            self.shutdown()
            raise
        except BaseException:  # GeneratorExit too: a stream its reader dropped
            for rid in request_ids:
                self.engine.abort_request(rid)
            if not self.engine.executor.is_alive():
                self._dead = "the pipeline failed earlier; create a new LLM"
                self.shutdown()
            raise

    def _drain(self) -> None:
        while self.engine.in_flight:  # async scheduling: a batch sent ahead for a request that has since stopped
            self.engine.step(fill=False)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """As vLLM's LLM.chat. chat_template: a Jinja template to use instead of the tokenizer's. tools: OpenAI's
        tool definitions, for the template to show the model (the output is text: its tool calls are not parsed).
        continue_final_message: the model continues the last (assistant) message, with add_generation_prompt=False.
        chat_template_kwargs: the template's own variables (Qwen3's enable_thinking, ...). lora_request: as
        generate's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(conv, add_generation_prompt, chat_template, tools, continue_final_message,
                                    chat_template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
                    tools: list[dict] | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> dict:
        """One conversation through the chat template: {"prompt": text, "prompt_token_ids": ids}."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text, ids = chat.render(self.engine.tokenizer, messages, chat_template, tools, add_generation_prompt,
                                continue_final_message, chat_template_kwargs, "use generate() with a plain prompt")
        return {"prompt": text, "prompt_token_ids": ids}


def _prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a dict, or a non-empty list of them")
    return list(prompts)


def _close(engine: LLMEngine, trace_dir: str | None) -> None:
    try:
        if trace_dir is not None and engine.executor.is_alive():
            from pipellm.observe.trace import save_trace
            save_trace(engine, trace_dir)
    finally:
        engine.shutdown()
