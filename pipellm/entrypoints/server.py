"""`pipellm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncEngine; its routes (the work they
share: openai_server.py).

/v1/models, /v1/completions, /v1/chat/completions (with SSE streaming), /v1/responses (and /v1/responses/{id}: a
kept response, its input items, its cancel), /tokenize, /detokenize, /v1/load_lora_adapter and /v1/unload_lora_adapter
(as vLLM's), /health, /version, /metrics.
User errors come back in OpenAI's error shape with 400/401/404/413, a dead pipeline or a full queue gives 503: never a
500 for user input.
"""
import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import pipellm
from pipellm import chat
from pipellm.engine.async_engine import StreamDelta
from pipellm.engine.engine import LLMEngine
from pipellm.entrypoints.harmony import HarmonyStream
from pipellm.entrypoints.harmony import split as split_harmony
from pipellm.entrypoints.openai_server import OpenAIServer, ServerConfig, for_model
from pipellm.entrypoints.protocol import (APIError, ChatMessage, ChatRequest, ChatTemplateFields, CompletionLogprobs,
                                          CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                          UnloadLoRAAdapterRequest, chat_logprobs, parse_request, sampling_params,
                                          usage)
from pipellm.entrypoints.reasoning import ReasoningStream
from pipellm.entrypoints.reasoning import split as split_reasoning
from pipellm.entrypoints.responses import (Reply, ResponsesRequest, ResponseStore, chat_body, input_items,
                                           listed_items, renamed)
from pipellm.entrypoints.tools import ReplyStream, check_tools, choice_of, forced_output
from pipellm.entrypoints.tools import parse as parse_tool_calls
from pipellm.observe.metrics import CONTENT_TYPE

logger = logging.getLogger("pipellm.server")


# ---- endpoints ------------------------------------------------------------------------------------------------

class _Endpoints:
    def __init__(self, server: OpenAIServer):
        self.s = server
        self.store = ResponseStore(server.config.responses_store_size)

    def completion_prompts(self, prompt) -> tuple[list[list[int]], list[str | None]]:
        """Each prompt's token ids, and its text when it came as text."""
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            raise APIError(400, "prompt is empty; give a string, a list of strings, or token ids", param="prompt")
        tokenizer = self.s.async_engine.tokenizer
        if tokenizer is None and any(isinstance(p, str) for p in items):
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        return ([tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items],
                [p if isinstance(p, str) else None for p in items])

    def decode_token(self, token_id: int) -> str:
        tokenizer = self.s.async_engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id])

    def chat_prompt(self, messages: list[ChatMessage], options: ChatTemplateFields,
                    tools: list[dict] | None = None) -> list[int]:
        conversation = [{"role": m.role, "content": m.content or ""}
                        | {k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(m, k)) is not None}
                        # a thought, under Qwen3's name, and GPT-OSS's where its template takes it (not beside
                        # both content and calls, which that template refuses)
                        | ({"reasoning_content": m.reasoning_content} if m.reasoning_content is not None else {})
                        | ({"thinking": m.reasoning_content}
                           if m.reasoning_content is not None and not (m.content and m.tool_calls) else {})
                        for m in messages]
        try:
            return chat.render(self.s.async_engine.tokenizer, conversation, self.s.config.chat_template, tools,
                               options.add_generation_prompt, options.continue_final_message,
                               options.chat_template_kwargs,
                               "use /v1/completions (or start the server with --chat-template)")[1]
        except chat.ChatTemplateError as e:
            raise APIError(400, str(e), param=e.param) from None

    def base(self, prefix: str, kind: str, model: str | None) -> dict:
        """A response's first fields; its model is the request's LoRA adapter, or the served model."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": model if model in self.s.loras else self.s.config.served_model_name}

    async def completions(self, request: Request):
        s = self.s
        s.check_key(request)
        req = parse_request(CompletionRequest, await s.read_json(request))
        s.check_model_and_engine(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        echo = bool(req.echo)
        # OpenAI's default is 16 new tokens; without an explicit max_tokens the engine caps it at what fits.
        max_tokens = s.sampling_defaults.get("max_tokens", 16) if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens=0 asks for no completion: give echo=true (with logprobs, to score the "
                           "prompt) or max_tokens >= 1", param="max_tokens")
        # max_tokens 0: the engine still makes one token (a prefill ends in a sample), which is dropped
        params = sampling_params(req, max_tokens or 1, req.logprobs, req.logprobs if echo else None,
                                  s.sampling_defaults)
        prompts, texts = self.completion_prompts(req.prompt)
        if params.truncate_prompt_tokens:  # echo and usage speak of the prompt that runs
            texts = [t if len(p) <= params.truncate_prompt_tokens else None for p, t in zip(prompts, texts)]
            prompts = [s.engine.inputs.truncated(p, params) for p in prompts]
        work = await s.checked_work(req, prompts, params, req.max_tokens is not None)
        base = self.base("cmpl", "text_completion", req.model)
        logprobs = [CompletionLogprobs(self.decode_token) for _ in range(len(prompts) * params.n)]
        echoed = [not echo] * len(logprobs)

        def choice(index: int, text: str, token_ids, entries, finish_reason, stop_reason,
                   prompt_entries=None) -> dict:
            if max_tokens == 0:
                text, token_ids, entries = "", [], []
            if not echoed[index]:  # the prompt comes first, once, as vLLM's server echoes it
                echoed[index] = True
                prompt = index // params.n
                text = (texts[prompt] if texts[prompt] is not None else
                        s.async_engine.tokenizer.decode(prompts[prompt]) if s.async_engine.tokenizer else "") + text
                token_ids, entries = prompts[prompt] + list(token_ids), (prompt_entries or []) + list(entries or [])
            lps = logprobs[index].format(token_ids, entries) if params.logprobs is not None else None
            return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}

        if req.stream:
            def make_choice(index: int, d: StreamDelta) -> dict | None:
                if not d.text and d.finish_reason is None and not (d.logprobs and d.token_ids) and echoed[index]:
                    return None
                return choice(index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason,
                              d.prompt_logprobs)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(s.sse(base, work, include_usage, make_choice), media_type="text/event-stream")
        choices = await s.collect_unless_gone(request, base["id"], work)
        if choices is None:
            return Response(status_code=499)  # nobody is listening
        return base | {"choices": [choice(i, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
                                          c.prompt_logprobs) for i, c in enumerate(choices)],
                       "usage": usage(prompts, sum(len(c.token_ids) for c in choices) if max_tokens else 0)}

    async def chat(self, request: Request):
        self.s.check_key(request)
        return await self.chat_reply(request, parse_request(ChatRequest, await self.s.read_json(request)))

    async def responses(self, request: Request):
        """OpenAI's Responses API, run as a chat completion (responses.py)."""
        self.s.check_key(request)
        data = await self.s.read_json(request)
        req = parse_request(ResponsesRequest, data)
        stored = req.store and self.store.size > 0
        if req.background and not stored:
            raise APIError(400, "background: a background response is kept until it is read; give store=true, on a "
                           "server started with --responses-store-size N (N > 0)", param="background")
        if req.background and req.stream:
            raise APIError(400, "background: give stream or background, not both (poll GET /v1/responses/{id} for a "
                           "background response)", param="background")
        history = self.store.history(req.previous_response_id) if req.previous_response_id is not None else []
        out = Reply(req, req.model or self.s.config.served_model_name, stored)
        try:
            reply = await self.chat_reply(request, parse_request(ChatRequest, chat_body(req, data, history)))
        except APIError as e:
            raise renamed(e) from None
        if not isinstance(reply, (dict, StreamingResponse)):
            return reply  # 499: the client went away
        items = listed_items(input_items(req))
        if req.background:
            self.store.put(out, items, asyncio.create_task(out.run(reply.body_iterator)))
            return out.now()
        if stored:
            out.on_end = lambda reply: self.store.put(reply, items)
        if isinstance(reply, StreamingResponse):
            return StreamingResponse(out.events(reply.body_iterator), media_type="text/event-stream")
        return out.from_chat(reply)

    async def response(self, request: Request, response_id: str):
        """A kept response, as it stands (a background one: its output so far)."""
        self.s.check_key(request)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "stream: this server gives a kept response whole; poll it without stream",
                           param="stream")
        return self.store.get(response_id).reply.now()

    async def delete_response(self, request: Request, response_id: str):
        self.s.check_key(request)
        self.store.delete(response_id)  # a background one still running stops
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel_response(self, request: Request, response_id: str):
        """Stops a background response; one that has ended comes back as it is."""
        self.s.check_key(request)
        kept = self.store.get(response_id)
        if kept.task is None:
            raise APIError(400, f"response {response_id!r} did not run in the background: only a background "
                           "response can be cancelled", param="response_id")
        kept.task.cancel()
        await asyncio.wait({kept.task}, timeout=10)
        kept.reply.cancelled()  # also one cancelled before it began
        return kept.reply.now()

    async def response_input_items(self, request: Request, response_id: str):
        """A kept response's input items (its own turn, as OpenAI's list): ?limit=1..100 (20), order=asc|desc
        (desc), after=an item id."""
        self.s.check_key(request)
        items = self.store.get(response_id).items
        query = request.query_params
        limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise APIError(400, f"limit {limit!r}: give a whole number from 1 to 100", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order {order!r}: give asc or desc", param="order")
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after {after!r}: not an item of this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    async def chat_reply(self, request: Request, req: ChatRequest):
        """A chat completion (a dict), its stream, or 499 for a client that went away."""
        s = self.s
        s.check_model_and_engine(req.model)
        tools = check_tools(req.tools) if req.tools else None
        tool_choice = choice_of(tools, req.tool_choice, s.config.tool_call_parser)
        parallel = req.parallel_tool_calls is not False
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # the model's default, else up to max_model_len, as OpenAI's chat does
            max_tokens = s.sampling_defaults.get("max_tokens")
        params = sampling_params(req, max_tokens, top_k, defaults=s.sampling_defaults)
        if (forced := forced_output(tools, tool_choice, parallel)) is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} holds the output to the tools' JSON: give no "
                               "response_format or structured_outputs with it", param="tool_choice")
            params.structured_outputs = forced
        parser = s.config.reasoning_parser
        harmony = parser == "openai_gptoss"
        harmony_calls = harmony and tool_choice == "auto"  # else a forced choice's calls are the text's JSON
        if harmony:  # its markers are special tokens, which the parser reads and takes out
            params.skip_special_tokens = False
        prompts = [s.engine.inputs.truncated(self.chat_prompt(req.messages, req, tools), params)]
        work = await s.checked_work(req, prompts, params, max_tokens is not None)
        base = self.base("chatcmpl", "chat.completion", req.model)

        def lps(token_ids, entries):
            return chat_logprobs(token_ids, entries, top_k) if top_k is not None else None

        def message(text: str, finish_reason: str) -> tuple[dict, bool]:  # the message; whether it calls tools
            if harmony:
                reasoning, content, calls = split_harmony(text, harmony_calls, parallel, finish_reason)
                if not harmony_calls:
                    content, calls = parse_tool_calls(content, tool_choice, parallel)
                content = (content or None) if calls else content
            else:
                reasoning, text = split_reasoning(text, parser) if parser else (None, text)
                content, calls = parse_tool_calls(text, tool_choice, parallel, s.config.tool_call_parser)
            return {"role": "assistant", "content": content} | ({"reasoning_content": reasoning} if parser else {}) \
                | ({"tool_calls": calls} if calls else {}), bool(calls)

        if req.stream:
            base["object"] = "chat.completion.chunk"
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)]
            thoughts = [HarmonyStream(harmony_calls, parallel) if harmony else ReasoningStream(parser)
                        for _ in range(params.n)] if parser else None
            replies = [ReplyStream(tool_choice, parallel, s.config.tool_call_parser) for _ in range(params.n)] \
                if tool_choice != "none" and not harmony_calls else None

            def make_choice(index: int, d: StreamDelta) -> dict | None:
                finished, calls = d.finish_reason is not None, []
                if harmony:
                    reasoning, content, calls = thoughts[index].add(d.text, d.finish_reason)
                else:
                    reasoning, content = thoughts[index].add(d.text, finished) if thoughts else ("", d.text)
                if replies:  # a reply that may call tools: its calls whole, in its last chunk
                    content, calls = replies[index].add(content, finished)
                with_logprobs = tool_choice == "none" and d.logprobs and d.token_ids
                if not (reasoning or content or calls or finished or with_logprobs):
                    return None
                delta = ({"reasoning_content": reasoning} if reasoning else {}) | (
                    {"content": content} if content else {}) | (
                    {"tool_calls": [call | {"index": i} for i, call in enumerate(calls)]} if calls else {})
                return {"index": index, "delta": delta,
                        "logprobs": lps(d.token_ids, d.logprobs) if tool_choice == "none" else None,
                        "finish_reason": "tool_calls" if calls else d.finish_reason, "stop_reason": d.stop_reason}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(s.sse(base, work, include_usage, make_choice, first),
                                     media_type="text/event-stream")
        choices = await s.collect_unless_gone(request, base["id"], work)
        if choices is None:
            return Response(status_code=499)
        replies = [message(c.text, c.finish_reason) for c in choices]
        return base | {"choices": [{"index": i, "message": msg, "logprobs": lps(c.token_ids, c.logprobs),
                                    "finish_reason": "tool_calls" if calls else c.finish_reason,
                                    "stop_reason": c.stop_reason} for i, (c, (msg, calls)) in
                                   enumerate(zip(choices, replies))],
                       "usage": usage(prompts, sum(len(c.token_ids) for c in choices))}

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: the token ids of a prompt, or of chat messages through the template."""
        s = self.s
        s.check_key(request)
        req = parse_request(TokenizeRequest, await s.read_json(request))
        s.check_model_and_engine(req.model)
        tokenizer = s.async_engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give a prompt or messages (one of them)", param="prompt")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        ids = self.chat_prompt(req.messages, req) if req.messages is not None else \
            tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": s.engine.max_model_len, "tokens": ids, "token_strs": None}

    async def detokenize(self, request: Request):
        s = self.s
        s.check_key(request)
        req = parse_request(DetokenizeRequest, await s.read_json(request))
        s.check_model_and_engine(req.model)
        vocab = s.engine.model_config.vocab_size
        if s.async_engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens has ids outside [0, {vocab})", param="tokens")
        return {"prompt": s.async_engine.tokenizer.decode(req.tokens)}

    async def models(self, request: Request):
        self.s.check_key(request)
        name = self.s.config.served_model_name  # "root" is the name too: a local path tells clients nothing useful
        card = {"id": name, "object": "model", "created": self.s.created, "owned_by": "pipellm", "root": name,
                "max_model_len": self.s.engine.max_model_len}
        adapters = [{"id": lora.lora_name, "object": "model", "created": self.s.created, "owned_by": "pipellm",
                     "root": str(lora.lora_path), "parent": name, "max_model_len": self.s.engine.max_model_len}
                    for lora in self.s.loras.values()]  # as vLLM lists them
        return {"object": "list", "data": [card, *adapters]}

    async def load_lora_adapter(self, request: Request):
        """vLLM's: {"lora_name", "lora_path", "load_inplace"}; its answer is plain text."""
        self.s.check_key(request)
        self.s.check_lora_updating()
        req = parse_request(LoadLoRAAdapterRequest, await self.s.read_json(request))
        await self.s.load_lora(req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request):
        self.s.check_key(request)
        self.s.check_lora_updating()
        req = parse_request(UnloadLoRAAdapterRequest, await self.s.read_json(request))
        await self.s.unload_lora(req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def health(self):
        ae = self.s.async_engine
        dead = ae.dead_reason()
        body = {"status": "dead" if dead else "ok", "stages": ae.stage_status(), "error": dead}
        return JSONResponse(body, status_code=503 if dead else 200)

    async def version(self):
        return {"version": pipellm.__version__}

    async def metrics(self, request: Request):
        if not self.s.config.metrics_public:
            self.s.check_key(request)
        return Response(self.s.metrics.render(), media_type=CONTENT_TYPE)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    server = OpenAIServer(engine, config)
    ep = _Endpoints(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        yield
        ep.store.close()
        await asyncio.to_thread(server.async_engine.stop)  # ends what is left with finish_reason "abort"
        if config.trace_dir is not None and engine.executor.is_alive():
            await asyncio.to_thread(_write_trace, engine, config.trace_dir)  # the engine thread has ended
        engine.shutdown()

    app = FastAPI(title="pipellm", version=pipellm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    if config.allowed_origins:  # none by default: a page the user visits may not call a local server
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"])
    app.add_api_route("/v1/completions", ep.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", ep.chat, methods=["POST"])
    app.add_api_route("/v1/responses", ep.responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", ep.response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", ep.delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", ep.cancel_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}/input_items", ep.response_input_items, methods=["GET"])
    app.add_api_route("/v1/models", ep.models, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", ep.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", ep.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", ep.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", ep.detokenize, methods=["POST"])
    app.add_api_route("/health", ep.health, methods=["GET"])
    app.add_api_route("/version", ep.version, methods=["GET"])
    app.add_api_route("/metrics", ep.metrics, methods=["GET"])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):  # unknown route, wrong method
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        logger.exception("internal error", exc_info=exc)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", "server_error").body,
                            status_code=500)

    return app


def _write_trace(engine: LLMEngine, trace_dir: str) -> None:
    from pipellm.observe.trace import save_trace
    summary = save_trace(engine, trace_dir)  # aborted requests' batches may still be on their way back
    print(f"trace written to {trace_dir}: bubble {summary['bubble_pct']:.1f}%", flush=True)


def run_server(model: str | None, engine_kwargs: dict, config: ServerConfig, sock) -> None:
    """Serves until SIGINT/SIGTERM on sock, the config's address bound before the engine starts (cli's _bind)."""
    import uvicorn

    from pipellm.config import EngineConfig

    try:
        engine = LLMEngine(EngineConfig(model, trace=config.trace_dir is not None, **engine_kwargs))
        try:
            if config.chat_template is not None and engine.tokenizer is not None:
                try:  # a template that cannot render one message fails every chat request: refused at the start
                    chat.render(engine.tokenizer, [{"role": "user", "content": "Hi"}], config.chat_template, None,
                                True, False, None, "")
                except chat.ChatTemplateError as e:
                    raise ValueError(f"--chat-template: {e}") from None
            config = for_model(config, engine.model_config.architecture)  # its parsers: refused before it serves
            for stage in engine.stages:
                print(stage.describe(), flush=True)
            host, port = sock.getsockname()[:2]
            print(f"serving {config.served_model_name} at http://{f'[{host}]' if ':' in host else host}:{port}/v1",
                  flush=True)
            server = uvicorn.Server(uvicorn.Config(build_app(engine, config), host=config.host, port=config.port,
                                                   log_level=config.log_level,
                                                   timeout_graceful_shutdown=config.graceful_shutdown_s))
            server.run(sockets=[sock])
            if not server.started:
                raise SystemExit(3)  # as uvicorn.run: its startup failed, and its log says why
        finally:
            engine.shutdown()
    finally:
        sock.close()
