"""The OpenAI-compatible server's state and the work its endpoints share (server.py holds the routes): its
settings, request checks (key, size, model, room, prompts), running a request's prompts on the AsyncEngine, and
streaming their deltas as server-sent events."""
import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from starlette.requests import ClientDisconnect

from pipellm.beam_search import BeamSearch, BeamSearchSequence, beam_search_async
from pipellm.config import check_generation_config, sampling_defaults
from pipellm.engine.async_engine import (AsyncEngine, EngineDeadError, RequestFailedError, RequestRefusedError,
                                         StreamDelta)
from pipellm.engine.engine import LLMEngine
from pipellm.entrypoints.protocol import (APIError, LoadLoRAAdapterRequest, SamplingFields, UnloadLoRAAdapterRequest,
                                          beam_search_params, usage)
from pipellm.entrypoints.reasoning import PARSERS as reasoning_parsers
from pipellm.entrypoints.tools import PARSERS as tool_parsers
from pipellm.lora import LoRARequest
from pipellm.observe.metrics import ServerMetrics
from pipellm.sampling_params import SamplingParams

logger = logging.getLogger("pipellm.server")
MAX_JSON_DEPTH = 64  # a request body's nesting; JSON schemas of tools and response formats stay far below it


@dataclass
class ServerConfig:
    served_model_name: str              # the name clients pass as `model`
    host: str = "127.0.0.1"             # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None          # when set, /v1/* and /metrics need "Authorization: Bearer <key>"
    metrics_public: bool = False        # /metrics without the API key
    max_request_bytes: int = 1 << 20    # larger request bodies get 413
    max_request_seqs: int = 256         # prompts x n in one request; more get 400
    max_request_tokens: int = 1 << 20   # prompt + completion tokens one request may ask for, over all its choices
    max_waiting_seqs: int = 1024        # sequences waiting for the engine; while as many wait, 503 + Retry-After
    log_level: str = "info"
    graceful_shutdown_s: float = 30.0   # on SIGINT/SIGTERM, in-flight requests get this long to finish
    trace_dir: str | None = None        # on shutdown, write the pipeline trace and pictures here
    generation_config: str = "auto"     # sampling defaults for fields a request leaves out: "auto" (the model's
    #                                     generation_config.json, as vLLM), "vllm" (none), or a folder holding one
    tool_call_parser: str | None = None  # tool_choice "auto": how the model writes its calls (tools.PARSERS)
    chat_template: str | None = None    # a Jinja template for chat completions instead of the tokenizer's
    reasoning_parser: str | None = None  # the thought in a message's reasoning_content (reasoning.PARSERS)
    allowed_origins: tuple[str, ...] = ()  # web pages (origins) whose scripts may call the API (CORS); "*" any
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder): LoRA adapters clients name as `model`
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    responses_store_size: int = 1000    # the last responses kept for previous_response_id, GET and background; 0 none

    def __post_init__(self):
        check_generation_config(self.generation_config)  # before the engine starts
        for name, known in (("tool_call_parser", tool_parsers), ("reasoning_parser", reasoning_parsers)):
            if getattr(self, name) not in (None, *known):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: give one of {', '.join(known)}")
        if self.reasoning_parser == "openai_gptoss" and self.tool_call_parser not in (None, "openai"):
            raise ValueError("--reasoning-parser openai_gptoss reads GPT-OSS's harmony replies: give "
                             f"--tool-call-parser openai, not {self.tool_call_parser}")
        if self.tool_call_parser == "openai" and self.reasoning_parser not in (None, "openai_gptoss"):
            raise ValueError("--tool-call-parser openai reads GPT-OSS's harmony replies: give --reasoning-parser "
                             f"openai_gptoss, not {self.reasoning_parser}")
        for name in ("max_request_bytes", "max_request_seqs", "max_request_tokens", "max_waiting_seqs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive integer")
        if not isinstance(self.responses_store_size, int) or self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size {self.responses_store_size}: give 0 (keep none) or more")


@dataclass
class _Choice:
    """A completion's output gathered for a non-streaming response."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None


@dataclass
class Work:
    """What a request runs once checked: its prompts' token ids, their sampling, and how they are scheduled."""
    prompts: list[list[int]]
    params: SamplingParams          # n: the choices per prompt (a beam search's width)
    search: BeamSearch | None = None  # use_beam_search: the beams, grown a token per step
    priority: int = 0               # scheduling_policy "priority": lower runs first
    lora: LoRARequest | None = None  # the adapter the request's model names


class OpenAIServer:
    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.config, self.engine = for_model(config, engine.model_config.architecture), engine
        self.loras = lora_modules(engine, config)
        self._lora_ids = itertools.count(len(self.loras) + 1)  # never one again: a removed adapter's is not reused
        self._lora_lock = asyncio.Lock()  # one load or unload at a time
        self.async_engine = AsyncEngine(engine)
        self.metrics = ServerMetrics(config.served_model_name, lambda: self.async_engine.stats)
        self.async_engine.metrics = self.metrics
        self.created = int(time.time())
        self.sampling_defaults = sampling_defaults(config.generation_config, engine.model_dir)

    # ---- checks shared by the endpoints -----------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken says nothing about how much of the key matched.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length", "")
        too_big = APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        try:
            async for chunk in request.stream():  # counted as it arrives: a chunked body has no content-length
                body += chunk
                if len(body) > limit:
                    raise too_big
        except ClientDisconnect:
            raise APIError(499, "the client closed the connection") from None
        try:
            data = json.loads(body)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep") from None
        if _depth(data) > MAX_JSON_DEPTH:  # deeper, checks and templates would recurse past Python's limit
            raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data

    def check_model_and_engine(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name and model not in self.loras:
            names = ", ".join(repr(n) for n in [self.config.served_model_name, *self.loras])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {names}", param="model",
                           code="model_not_found")
        dead = self.async_engine.dead_reason()
        if dead:
            raise APIError(503, f"the engine is dead: {dead}", type_="server_error", code="engine_dead")

    def check_size_and_room(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Caps what one request may ask for (400), and turns it away while too much waits already (503)."""
        cfg, limit = self.config, self.engine.max_model_len
        num_seqs = len(prompts) * params.n
        if num_seqs > cfg.max_request_seqs:
            raise APIError(400, f"this request asks for {num_seqs} completions ({len(prompts)} prompts x n="
                           f"{params.n}); the server takes at most {cfg.max_request_seqs} per request "
                           "(--max-request-seqs); split it", param="n")
        # A missing max_tokens means up to max_model_len.
        tokens = params.n * sum(len(p) + min(params.max_tokens or limit, limit - len(p)) for p in prompts)
        if tokens > cfg.max_request_tokens:
            raise APIError(400, f"this request may take {tokens} tokens (prompts plus max_tokens, times n); the "
                           f"server takes at most {cfg.max_request_tokens} per request (--max-request-tokens); "
                           "lower max_tokens or n, or split it", param="max_tokens")
        waiting = self.async_engine.num_waiting_seqs()
        if waiting >= cfg.max_waiting_seqs:
            raise APIError(503, f"the server is overloaded: {waiting} sequences wait already (at most "
                           f"{cfg.max_waiting_seqs}, --max-waiting-seqs); retry later", type_="server_error",
                           code="overloaded", headers={"Retry-After": "1"})

    async def check_prompts(self, prompts: list[list[int]], params: SamplingParams, max_tokens_given: bool,
                            prompt_field: str = "prompt") -> None:
        def check():
            for ids in prompts:
                self.check_prompt(ids, params, max_tokens_given, prompt_field)
        if params.structured_outputs is None:
            return check()
        await asyncio.to_thread(check)  # a grammar compiles off the event loop (the first, ~0.5 s more: below)

    def check_prompt(self, ids: list[int], params: SamplingParams, max_tokens_given: bool,
                     prompt_field: str = "prompt") -> None:
        limit = self.engine.max_model_len
        if max_tokens_given and len(ids) + params.max_tokens > limit:
            raise APIError(400, f"this model's maximum context length (max_model_len) is {limit} tokens, but "
                           f"{len(ids) + params.max_tokens} were requested ({len(ids)} in the prompt, "
                           f"{params.max_tokens} for the completion); shorten the prompt or lower max_tokens",
                           param="max_tokens")
        try:
            self.engine.inputs.validate(ids, params)  # reads the config, compiles grammars: safe off the engine thread
        except ValueError as e:  # the field to change: a sampling field the message names, or the prompt
            field = re.match(r"SamplingParams\.(\w+)", str(e))
            raise APIError(400, str(e), param=field[1] if field else prompt_field if str(e).startswith(
                ("prompt_token_ids", "the prompt")) else None) from None

    async def checked_work(self, req: SamplingFields, prompts: list[list[int]], params: SamplingParams,
                           max_tokens_given: bool) -> Work:
        """The checks every request that generates passes, then what it runs."""
        if req.stream_options is not None and not req.stream:  # as vLLM's
            raise APIError(400, "stream_options applies to a streamed response: give stream=true with it, or leave "
                           "it out", param="stream_options")
        engine, beam = self.engine, beam_search_params(req, params, self.engine.max_model_len)
        priority = 0 if req.priority is None else req.priority
        try:
            engine.inputs.check_priority(priority)
        except ValueError as e:
            raise APIError(400, str(e).replace("start it", "start the server", 1), param="priority") from None
        await self.check_prompts(prompts, params, max_tokens_given, "prompt" if hasattr(req, "prompt") else "messages")
        self.check_size_and_room(prompts, params)
        lora = self.loras.get(req.model)
        if beam is None:
            return Work(prompts, params, priority=priority, lora=lora)
        try:
            search = BeamSearch(prompts, beam, engine.eos_token_ids, engine.max_model_len, engine.config.max_logprobs,
                                params.logprobs or 0)
        except ValueError as e:  # n beams rank 2n log-probabilities a step
            raise APIError(400, str(e).replace("beam_width", "n", 1), param="n") from None
        return Work(prompts, params, search, priority, lora)

    # ---- LoRA adapters added and removed while serving (--allow-runtime-lora-updating) ------------------------

    def check_lora_updating(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise APIError(404, "loading and unloading LoRA adapters while the server runs is off; start it with "
                           "--allow-runtime-lora-updating (and --enable-lora)", code="not_found")

    async def load_lora(self, req: LoadLoRAAdapterRequest) -> None:
        """Adds the adapter under its name (with load_inplace, in place of the one of that name), checked against
        the model first: a refused one leaves what was served as it was."""
        name = req.lora_name
        async with self._lora_lock:
            old = self.loras.get(name)
            if name == self.config.served_model_name or old is not None and not req.load_inplace:
                raise APIError(400, f"the name {name!r} is taken already" + (
                    "; unload that adapter first, or send load_inplace: true" if old else ""), param="lora_name")
            try:
                lora = LoRARequest(name, next(self._lora_ids), req.lora_path)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            try:  # in place of any adapter of that name the engine holds (see _forget)
                await self.engine_call(lambda engine: engine.add_lora(lora, replace=True))
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            self.loras[name] = lora
        logger.info("LoRA adapter %r %s from %s", name, "replaced" if old else "added", req.lora_path)

    async def unload_lora(self, req: UnloadLoRAAdapterRequest) -> None:
        """Removes the adapter of that name: new requests may not name it; those running it finish with it."""
        async with self._lora_lock:
            if self.loras.pop(req.lora_name, None) is None:
                raise APIError(404, f"no LoRA adapter {req.lora_name!r} is loaded; loaded: "
                               f"{', '.join(map(repr, self.loras)) or 'none'}", param="lora_name", code="not_found")
            await self.engine_call(lambda engine: _forget(engine, req.lora_name))
        logger.info("LoRA adapter %r removed", req.lora_name)

    async def engine_call(self, fn) -> None:
        try:
            await self.async_engine.call(fn)
        except TimeoutError:
            raise APIError(503, "the engine did not get to the request within 30 s; retry", type_="server_error",
                           headers={"Retry-After": "1"}) from None

    # ---- generation ---------------------------------------------------------------------------------------

    async def generate_all(self, request_id: str, work: Work):
        """Runs every prompt at once; yields (prompt index, deltas) as tokens come. With a beam search, its
        choices all come at its end: no beam is kept until the last step ranks them."""
        prompts, params = work.prompts, work.params
        if work.search is not None:
            outs = await beam_search_async(self.async_engine, request_id, work.search, work.priority, work.lora)
            for i, (ids, out) in enumerate(zip(prompts, outs)):
                yield i, [self._beam_choice(j, seq, len(ids), params) for j, seq in enumerate(out.sequences)]
            return
        if len(prompts) == 1:
            async with aclosing(self.async_engine.generate(request_id, prompts[0], params, work.priority,
                                                           work.lora)) as stream:
                async for deltas in stream:
                    yield 0, deltas
            return
        results: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async with aclosing(self.async_engine.generate(f"{request_id}-{i}", ids, params,
                                                               work.priority, work.lora)) as stream:
                    async for deltas in stream:
                        results.put_nowait((i, deltas))
                results.put_nowait((i, None))
            except Exception as e:
                results.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await results.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    remaining -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:  # a cancelled pump closes its stream, which aborts its request
                t.cancel()

    def _beam_choice(self, index: int, seq: BeamSearchSequence, prompt_len: int,
                     params: SamplingParams) -> StreamDelta:
        token_ids = seq.tokens[prompt_len:]
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]  # the EOS, as vLLM's server
        tokenizer = self.async_engine.tokenizer
        text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens) if tokenizer else ""
        entries = None
        if params.logprobs is not None:  # each token's, and the top k of its step (a step ranks more)
            entries = [{t: lp for t, lp in entry.items() if lp.rank <= params.logprobs or t == tid}
                       for tid, entry in zip(token_ids, seq.logprobs)]
        return StreamDelta(index, text, token_ids, entries, seq.finish_reason)

    async def collect(self, request_id: str, work: Work) -> list[_Choice]:
        n = work.params.n
        choices = [_Choice() for _ in range(len(work.prompts) * n)]
        try:
            async for i, deltas in self.generate_all(request_id, work):
                for d in deltas:
                    c = choices[i * n + d.index]
                    c.text += d.text
                    c.token_ids += d.token_ids
                    c.logprobs += d.logprobs or []
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                    c.prompt_logprobs = c.prompt_logprobs or d.prompt_logprobs
        except EngineDeadError as e:
            raise APIError(503, f"the engine is dead: {e}", type_="server_error", code="engine_dead") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), type_="server_error", code="request_failed") from None
        except RequestRefusedError as e:
            raise APIError(400, str(e)) from None
        return choices

    async def collect_unless_gone(self, request: Request, request_id: str, work: Work) -> list[_Choice] | None:
        """collect(), but a client that hangs up before the answer aborts its request (None)."""
        running = asyncio.ensure_future(self.collect(request_id, work))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not running.done():
                running.cancel()  # closes the streams, which aborts the requests and frees their KV blocks
        return running.result() if not running.cancelled() else None

    async def sse(self, base: dict, work: Work, include_usage: bool, make_choice, first_choices: list[dict] = ()):
        """The SSE body: a chunk per choice update (make_choice(index, delta) -> dict, or None to skip), then the
        usage (if asked), then [DONE]."""
        def event(obj) -> str:  # ASCII: clients that split lines as str.splitlines() does (httpx) also split at
            return f"data: {json.dumps(obj)}\n\n"  # U+2028, U+0085, ..., which a token's text may hold

        extra = {"usage": None} if include_usage else {}
        num_tokens = 0
        try:
            for choice in first_choices:
                yield event(base | {"choices": [choice]} | extra)
            async for i, deltas in self.generate_all(base["id"], work):
                for d in deltas:
                    num_tokens += len(d.token_ids)
                    choice = make_choice(i * work.params.n + d.index, d)
                    if choice is not None:
                        yield event(base | {"choices": [choice]} | extra)
            if include_usage:
                yield event(base | {"choices": [], "usage": usage(work.prompts, num_tokens)})
        except EngineDeadError as e:
            yield event(APIError(503, f"the engine is dead: {e}", "server_error", code="engine_dead").body)
        except RequestFailedError as e:
            yield event(APIError(500, str(e), "server_error", code="request_failed").body)
        except RequestRefusedError as e:
            yield event(APIError(400, str(e)).body)
        except Exception as e:  # the status line is gone already: say it in the stream
            logger.exception("internal error while streaming", exc_info=e)
            yield event(APIError(500, f"internal error: {type(e).__name__}", "server_error").body)
        yield "data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _depth(value) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 0)]
    while level:
        item, d = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                level.append((child, d + 1))
        deepest = max(deepest, d + isinstance(item, (dict, list)))
    return deepest


def lora_modules(engine: LLMEngine, config: ServerConfig) -> dict[str, LoRARequest]:
    """--lora-modules by name, each checked against the model before the server starts."""
    if config.allow_runtime_lora_updating and engine.adapters is None:
        raise ValueError("--allow-runtime-lora-updating loads adapters into the engine's LoRA slots: give "
                         "--enable-lora too (and --max-loras, --max-lora-rank as the adapters need)")
    loras: dict[str, LoRARequest] = {}
    for i, (name, path) in enumerate(config.lora_modules):
        try:
            if name in loras or name == config.served_model_name:
                raise ValueError(f"the name {name!r} is taken already; give each adapter a name of its own")
            loras[name] = LoRARequest(name, i + 1, path)
            engine.check_lora(loras[name])
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}".replace("enable_lora=True (--enable-lora)",
                                                                           "--enable-lora")) from None
    return loras


def _forget(engine: LLMEngine, name: str) -> None:
    """Removes the engine's adapter of that name, if any: the server's names are the ones that count (a request
    queued before an unload may have added its adapter again since)."""
    known = engine.adapters.known.get(name) if engine.adapters is not None else None
    if known is not None:
        engine.remove_lora(known[0].lora_int_id)


def for_model(config: ServerConfig, architecture: str) -> ServerConfig:
    """The config for the model it serves: a GPT-OSS model's replies are harmony, which the openai_gptoss parser
    reads (its default, as vLLM reads them so whatever it is told); another parser there would return its markup."""
    if architecture == "GptOssForCausalLM":
        if config.reasoning_parser not in (None, "openai_gptoss") or config.tool_call_parser not in (None, "openai"):
            given = config.reasoning_parser if config.reasoning_parser not in (None, "openai_gptoss") else \
                config.tool_call_parser
            raise ValueError(f"GPT-OSS writes harmony replies, which {given} cannot read: give --reasoning-parser "
                             "openai_gptoss (its default) and --tool-call-parser openai")
        if config.reasoning_parser is None:
            logger.info("reading GPT-OSS's harmony replies: --reasoning-parser openai_gptoss")
            config = dataclasses.replace(config, reasoning_parser="openai_gptoss")
    elif config.tool_call_parser == "openai" and config.reasoning_parser is None:
        raise ValueError(f"--tool-call-parser openai reads GPT-OSS's harmony replies, and this model is "
                         f"{architecture}: give --reasoning-parser openai_gptoss too if it writes them")
    return config
