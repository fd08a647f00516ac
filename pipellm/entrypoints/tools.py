"""Tool calls in chat completions, as vLLM's server makes them. The tools go to the model's chat template. With
tool_choice "required" or a named function the output is held to the calls' JSON (structured outputs); with "auto"
(`--enable-auto-tool-choice --tool-call-parser hermes|llama3_json`) the model's own call markup is read from its
text."""
import json
import re
import uuid

from pipellm.engine.detokenizer import stop_prefix_len
from pipellm.entrypoints.protocol import APIError
from pipellm.sampling_params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json", "openai")  # how a model writes its calls: Qwen2.5/3 and Hermes; Llama 3.1-3.3;
#                                               GPT-OSS's harmony messages to functions.NAME (harmony.py)
_MARK = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def check_tools(tools: list) -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}]: give " + '{"type": "function", "function": {"name": ..., "parameters": '
                           '{...JSON schema...}}}', param="tools")
    return tools


def choice_of(tools: list[dict] | None, tool_choice, parser: str | None) -> str | dict:
    """"none", "auto", "required", or the named tool's function; 400 for what this server cannot do."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return "none"
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        named = [t["function"] for t in tools if t["function"]["name"] == name]
        if not named:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
        return named[0]
    if choice not in ("none", "auto", "required"):
        raise APIError(400, 'tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', param="tool_choice")
    if choice == "auto" and parser is None:
        raise APIError(400, '"auto" tool choice needs a server started with --enable-auto-tool-choice '
                       '--tool-call-parser hermes (or llama3_json, or openai for GPT-OSS); or give tool_choice '
                       '"required" or a named function', param="tool_choice")
    return choice


def forced_output(tools: list[dict], choice, parallel: bool = True) -> StructuredOutputsParams | None:
    """The JSON a forced choice holds the output to: the named function's arguments, or for "required" a list of
    calls (one, unless parallel), each a function's name and its arguments."""
    if isinstance(choice, dict):
        return StructuredOutputsParams(json=choice.get("parameters") or {"type": "object"})
    if choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}}
                                   | ({} if parallel else {"maxItems": 1}))


def _call(name: str, arguments) -> dict:
    return call(name, json.dumps(arguments, ensure_ascii=False))


def call(name: str, arguments: str) -> dict:
    """An OpenAI tool call: the function's name and its arguments as a JSON text."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse(text: str, choice, parallel: bool = True, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """(the message's content, its tool calls) from a completion's text; one call at most unless parallel."""
    if choice == "none":
        return text, []
    try:
        if isinstance(choice, dict) or choice == "required":  # JSON the grammar held it to, unless max_tokens cut it
            value = json.loads(text)
            content, calls = None, ([_call(choice["name"], value)] if isinstance(choice, dict) else
                                    [_call(c["name"], c["parameters"]) for c in value])
        else:
            content, calls = (_hermes if parser == "hermes" else _llama3_json)(text)
    except (ValueError, KeyError, TypeError, AttributeError):  # a call that is not what it should be stays text
        return text, []
    return (content, calls if parallel else calls[:1]) if calls else (text, [])


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, after any text."""
    calls = [_call(c["name"], c.get("arguments", {})) for c in map(json.loads, _HERMES.findall(text))]
    return text[:text.find(_MARK)].strip() or None, calls


def _llama3_json(text: str) -> tuple[None, list[dict]]:
    """The whole reply: {"name": ..., "parameters": {...}} (or "arguments"), several separated by ';', after an
    optional <|python_tag|>. A reply that does not open so has no call."""
    body = text.lstrip()
    body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return None, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        found, at = decoder.raw_decode(body, at)
        calls.append(_call(found["name"], found["arguments"] if "arguments" in found else found["parameters"]))
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return None, calls


class ReplyStream:
    """A streamed reply that may call tools. With "auto" its text streams until a call begins (a tail that could
    begin one waits for the next piece); a forced reply is all calls. The calls come whole, once it is finished."""

    def __init__(self, choice, parallel: bool = True, parser: str = "hermes"):
        self.choice, self.parallel, self.parser = choice, parallel, parser
        self.text, self.num_sent = "", 0

    def add(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        """(the content to send now, the tool calls: only once finished)"""
        self.text += piece
        end = self._sendable(finished) if self.choice == "auto" else 0  # a forced reply's text is its calls' JSON
        calls = []
        if finished:
            _, calls = parse(self.text, self.choice, self.parallel, self.parser)
            if not calls:  # no call after all: the text is the content
                end = len(self.text)
        content = self.text[self.num_sent:end]
        self.num_sent = max(self.num_sent, end)
        return content, calls

    def _sendable(self, finished: bool) -> int:
        """How much of the text is content for sure."""
        text = self.text
        if self.parser == "hermes":
            at = text.find(_MARK)
            return at if at != -1 else len(text) - (0 if finished else stop_prefix_len(text, [_MARK]))
        stripped = text.lstrip()  # llama3_json: a reply is a call, or none, from its start
        if stripped.startswith(("{", _PYTHON_TAG)) or not finished and _PYTHON_TAG.startswith(stripped):
            return 0
        return len(text)
