"""OpenAI's Responses API (/v1/responses) over the chat completions the server runs: a request's input items become
chat messages (its instructions the system message, function calls and their outputs the assistant's tool calls and
the tool messages), its tools and text format the chat's; the chat's reply becomes the response's output items
(reasoning, message, function calls), and a streamed reply's chunks the Responses API's events. ResponseStore keeps
the last responses in memory, for previous_response_id, GET /v1/responses/{id} and background mode."""
import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import BaseModel

from pipellm.entrypoints.protocol import STRICT, APIError

logger = logging.getLogger("pipellm.server")

# the chat request's fields by the names a Responses request gives them, for errors that name a field
_FIELDS = {"max_completion_tokens": "max_output_tokens", "SamplingParams.max_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


# The chat's sampling fields that the Responses API does not name, taken as they are (as vLLM's extra parameters)
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "allowed_token_ids",
                   "bad_words", "logit_bias", "structured_outputs", "priority", "skip_special_tokens",
                   "chat_template_kwargs")


class ResponsesRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    input: str | list
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    metadata: dict | None = None
    previous_response_id: str | None = None
    user: str | None = None
    store: bool = True
    background: bool = False


def input_items(req: ResponsesRequest) -> list:
    """The request's input as a list of items (not yet checked)."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def chat_body(req: ResponsesRequest, data: dict, history: list[dict] = ()) -> dict:
    """The chat completions request that runs a Responses request (data: its body, for SAMPLING_EXTRAS; history: the
    items of the conversation before it, from previous_response_id); APIError for what it cannot be."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = input_items(req)
    if not items:
        raise APIError(400, "input is empty; give a string or a list of items", param="input")
    for i, item in enumerate([*history, *items], -len(history)):  # the history's were checked when they came
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}]: an item is an object ({{'role': 'user', 'content': ...}}, ...), not "
                           f"{type(item).__name__}", param="input")
        kind = item.get("type", "message")
        try:
            if kind == "message":
                role = _str(item, "role")
                if role not in ("system", "user", "assistant", "developer"):
                    raise ValueError(f"role {role!r}: give user, assistant, system or developer")
                messages.append({"role": "system" if role == "developer" else role, "content": _text(item["content"])})
            elif kind == "function_call":
                call = {"id": _str(item, "call_id"), "type": "function",
                        "function": {"name": _str(item, "name"), "arguments": _str(item, "arguments")}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # the calls of one turn, together
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _str(item, "call_id"),
                                 "content": _text(item["output"])})
            elif kind != "reasoning":  # an earlier reply's thought: not shown to the model again, as chat's
                raise ValueError(f"type {kind!r}: give message, function_call or function_call_output items")
        except KeyError as e:
            raise APIError(400, f"input[{i}]: a {kind} item needs {e.args[0]!r}", param="input") from None
        except (TypeError, ValueError) as e:
            raise APIError(400, f"input[{i}]: {e}", param="input") from None
    body = {"model": req.model, "messages": messages, "stream": req.stream or req.background,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls}
    if req.stream or req.background:  # a background response runs as a stream nobody reads
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object: {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       param="text")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format: a json_schema format needs its 'schema' (a JSON schema object)",
                           param="text")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt.get("type") == "json_object":
        body["response_format"] = fmt
    elif fmt.get("type") != "text":
        raise APIError(400, f"text.format.type {fmt.get('type')!r}: give text, json_object or json_schema",
                       param="text")
    return {k: v for k, v in body.items() if v is not None} | {k: data[k] for k in SAMPLING_EXTRAS if k in data}


def _str(item: dict, key: str) -> str:
    if not isinstance(item[key], str):
        raise TypeError(f"{key} must be a string")
    return item[key]


def _text(content) -> str:
    """A message's text: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"content must be a string or a list of parts, not {type(content).__name__}")
    kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
    if not kinds <= {"input_text", "output_text", "text"}:
        raise ValueError(f"content parts {sorted(map(str, kinds - {'input_text', 'output_text', 'text'}))}: this "
                         "server takes text parts only (input_text)")
    return "".join(p.get("text", "") for p in content)


def _chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or \
            not isinstance(tool.get("parameters", {}), dict):
        raise APIError(400, f"tools[{i}]: give function tools ({{'type': 'function', 'name': ..., 'parameters': "
                       "{...JSON schema...}}); this server has no built-in tools", param="tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def renamed(e: APIError) -> APIError:
    """A chat error in the Responses API's field names."""
    err = e.body["error"]
    for chat, ours in _FIELDS.items():
        err["message"] = err["message"].replace(chat, ours)
    err["param"] = _FIELDS.get(err["param"], err["param"])
    return e


class Reply:
    """A response's fields, and its output items from chat messages or streamed chunks."""

    def __init__(self, req: ResponsesRequest, model: str, stored: bool):
        self.head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                     "status": "queued" if req.background else "in_progress", "background": req.background,
                     "error": None, "incomplete_details": None,
                     "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
                     "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                     "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
                     "tool_choice": req.tool_choice or "auto", "text": req.text or {"format": {"type": "text"}},
                     "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
                     "reasoning": None, "store": stored, "truncation": "disabled", "user": req.user, "usage": None}
        self.output: list[dict] = []
        self.final: dict | None = None  # the response once it has ended
        self.on_end: Callable[["Reply"], None] | None = None

    def now(self) -> dict:
        """The response as it stands: its output so far until it ends."""
        return self.final or self.head | {"output": list(self.output)}

    def end(self, response: dict) -> dict:
        self.final = response
        if self.on_end is not None:
            self.on_end(self)
        return response

    def done(self, finish_reason: str | None, usage: dict | None) -> dict:
        incomplete = finish_reason == "length"
        return self.end(self.head | {
            "status": "incomplete" if incomplete else "completed", "output": self.output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": usage and {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                                "total_tokens": usage["total_tokens"]}})

    def from_chat(self, completion: dict) -> dict:
        """The whole response from a chat completion."""
        choice = completion["choices"][0]
        message = choice["message"]
        if message.get("reasoning_content"):
            self.output.append(_item("reasoning", message["reasoning_content"], "completed"))
        if message.get("content") is not None or not message.get("tool_calls"):
            self.output.append(_item("message", message.get("content") or "", "completed"))
        self.output += [_call_item(c) for c in message.get("tool_calls") or []]
        return self.done(choice["finish_reason"], completion["usage"])

    async def run(self, chunks: AsyncIterator[str]) -> None:
        """A background response: its events run to the end with nobody reading them; cancelled, it ends
        cancelled (closing the chat stream aborts its request)."""
        self.head["status"] = "in_progress"
        try:
            async with aclosing(self.events(chunks)) as events:
                async for _ in events:
                    pass
        except asyncio.CancelledError:
            self.cancelled()
            raise

    def cancelled(self) -> None:
        if self.final is None:
            self.end(self.now() | {"status": "cancelled"})

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Responses API's server-sent events from a chat stream's (with its usage chunk)."""
        stream = _Events(self)
        try:
            async for event in self._events(stream, chunks):
                yield event
        except Exception as e:  # the status line is gone already: say it in the stream
            logger.exception("internal error while streaming a response", exc_info=e)
            for event in stream.failed({"code": "server_error", "message": f"internal error: {type(e).__name__}"}):
                yield event

    async def _events(self, stream: "_Events", chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield stream.event("response.created", response=self.head)
        yield stream.event("response.in_progress", response=self.head)
        finish_reason = usage = None
        async with aclosing(_chunks(chunks)) as bodies:
            async for body in bodies:
                if "error" in body:
                    for e in stream.failed(body["error"]):
                        yield e
                    return
                usage = body.get("usage") or usage
                for choice in body.get("choices") or []:
                    for e in stream.delta(choice["delta"]):
                        yield e
                    finish_reason = choice.get("finish_reason") or finish_reason
        # an empty reply is still a message
        for e in (stream.add("message", "") if not self.output else []) + stream.close():
            yield e
        final = self.done(finish_reason, usage)
        yield stream.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                           response=final)


class _Events:
    """A streamed reply's events, numbered, as its output items open, grow and close."""

    def __init__(self, reply: Reply):
        self.reply, self.seq = reply, 0
        self.item: dict | None = None  # the reasoning or message item being streamed

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1} | fields)}\n\n"

    def where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.reply.output) - 1}

    def delta(self, delta: dict) -> list[str]:
        out = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if delta.get(key):
                out += self.add(kind, delta[key])
        for call in delta.get("tool_calls") or []:  # each whole, in the last chunk
            out += self.close()
            item = _call_item(call)
            self.reply.output.append(item)
            at = {"item_id": item["id"], "output_index": len(self.reply.output) - 1}
            out += [self.event("response.output_item.added", output_index=at["output_index"],
                               item=item | {"arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **at, name=item["name"],
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=at["output_index"], item=item)]
        return out

    def add(self, kind: str, text: str) -> list[str]:
        out = []
        if self.item is None or self.item["type"] != kind:
            out += self.close()
            self.item = _item(kind, "", "in_progress")
            self.reply.output.append(self.item)
            out.append(self.event("response.output_item.added", output_index=len(self.reply.output) - 1,
                                  item=self.item | {"content": []}))
            if kind == "message":
                out.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                      part=self.item["content"][0]))
        if text:
            self.item["content"][0]["text"] += text
            out.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=text)
                       if kind == "reasoning" else
                       self.event("response.output_text.delta", **self.where(), content_index=0, delta=text,
                                  logprobs=[]))
        return out

    def close(self) -> list[str]:
        item = self.item
        if item is None:
            return []
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **self.where(), content_index=0, text=text)]
        else:
            out = [self.event("response.output_text.done", **self.where(), content_index=0, text=text, logprobs=[]),
                   self.event("response.content_part.done", **self.where(), content_index=0, part=item["content"][0])]
        item["status"], self.item = "completed", None
        return out + [self.event("response.output_item.done", output_index=len(self.reply.output) - 1, item=item)]

    def failed(self, error: dict) -> list[str]:
        response = self.reply.end(self.reply.head | {"status": "failed", "output": self.reply.output, "error": {
            "code": error.get("code") or "server_error", "message": error["message"]}})
        return self.close() + [self.event("error", code=error.get("code"), message=error["message"],
                                          param=error.get("param")),
                               self.event("response.failed", response=response)]


async def _chunks(sse: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The chat stream's chunks; a client that goes away closes the stream, which aborts its request."""
    async with aclosing(sse):
        async for event in sse:
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _item(kind: str, text: str, status: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def listed_items(items: list[dict]) -> list[dict]:
    """Checked input items as a response lists them: typed, each with an id, a message's content as parts."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                content = [{"type": "output_text" if item["role"] == "assistant" else "input_text", "text": content}]
            item = item | {"type": "message", "content": content, "status": item.get("status", "completed")}
        out.append({"id": f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"} | item)  # an id the item has stays
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass
class _Kept:
    reply: Reply
    items: list[dict]  # its input items (listed_items), the conversation's turn without the instructions
    task: asyncio.Task | None = None  # a background response's generation


class ResponseStore:
    """Responses kept for previous_response_id, GET /v1/responses/{id} and background mode: the last `size` made or
    read, in memory (a restart forgets them; `--responses-store-size`, 0 keeps none)."""

    def __init__(self, size: int):
        self.size = size
        self.kept: OrderedDict[str, _Kept] = OrderedDict()

    def put(self, reply: Reply, items: list[dict], task: asyncio.Task | None = None) -> None:
        self.kept[reply.head["id"]] = _Kept(reply, items, task)
        while len(self.kept) > self.size:
            self._drop(next(iter(self.kept)))

    def get(self, response_id: str, param: str | None = None) -> _Kept:
        if not self.size:
            raise APIError(404 if param is None else 400, "this server keeps no responses: start it with "
                           "--responses-store-size N (N > 0), or send the conversation so far as input",
                           code="not_found", param=param)
        kept = self.kept.get(response_id)
        if kept is None:
            raise APIError(404, f"response {response_id!r} not found: not made here, deleted, or dropped from the "
                           f"store, which keeps the last {self.size} responses (--responses-store-size)",
                           code="not_found", param=param)
        self.kept.move_to_end(response_id)  # a conversation in use stays
        return kept

    def history(self, response_id: str) -> list[dict]:
        """The items of the conversation up to and with a kept response: each turn's input and output, in order."""
        turns = []
        while response_id is not None:
            kept = self.get(response_id, "previous_response_id")
            status = (kept.reply.final or kept.reply.head)["status"]
            if status not in ("completed", "incomplete"):
                raise APIError(400, f"previous_response_id: response {response_id!r} is {status}; continue a "
                               "completed or incomplete one", param="previous_response_id")
            turns.append((response_id, kept.items + kept.reply.final["output"]))
            response_id = kept.reply.head["previous_response_id"]
        turns.reverse()
        for response_id, _ in turns:  # the conversation's oldest turn goes first
            self.kept.move_to_end(response_id)
        return [item for _, turn in turns for item in turn]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def close(self) -> None:
        """Cancels the background responses still running (the server stops)."""
        for kept in self.kept.values():
            if kept.task is not None:
                kept.task.cancel()

    def _drop(self, response_id: str) -> None:
        kept = self.kept.pop(response_id)
        if kept.task is not None:
            kept.task.cancel()
