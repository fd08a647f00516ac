"""GPT-OSS's harmony replies, read as vLLM's `--reasoning-parser openai_gptoss` and `--tool-call-parser openai` read
them. After the chat template's `<|start|>assistant`, a reply is messages, each a header and a body (here the
second's body is on a line of its own):

    <|channel|>analysis<|message|>The user wants Rome's weather.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>
    {"city": "Rome"}<|call|>

The analysis channel (and a message to a built-in tool) is the reasoning; a message to functions.NAME is a tool call;
the final channel, and commentary to no one, are the content. The markers are special tokens: the server keeps them
in the text for this parser (skip_special_tokens=False) and takes them out. The text leaves out the token that ended
the reply (<|return|> or <|call|>, as vLLM's does), so a message still open at the end ends there; where max_tokens
cut it, a call's text stays content. A reply that opens with neither a marker nor a recipient (one held to JSON by a
forced tool_choice) is all content."""
import json
import re

from pipellm.engine.detokenizer import stop_prefix_len
from pipellm.entrypoints.tools import call

MARKERS = [f"<|{name}|>" for name in ("start", "channel", "message", "end", "return", "call", "constrain")]
_MARKER = re.compile("|".join(map(re.escape, MARKERS)))
_OPENINGS = (*MARKERS, "to=")  # a reply opens with a header: a marker, or the recipient after <|start|>assistant
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyStream:
    """A reply read as its pieces come: each piece's (reasoning, content) deltas, and the tool calls once the reply
    is finished (finish_reason given). A tail that could begin a marker waits for the next piece."""

    def __init__(self, calls: bool, parallel: bool = True):
        self.want_calls, self.parallel = calls, parallel  # whether messages to functions are calls (tool_choice auto)
        self.text, self.at = "", 0
        self.plain: bool | None = None  # no header at the start: not harmony, all content
        self.header, self.kind, self.body = "", None, ""  # kind: where the open message's body goes; None = header
        self.fresh, self.sent = False, set()  # a second message of a kind starts on a new line
        self.calls: list[dict] = []

    def add(self, piece: str, finish_reason: str | None) -> tuple[str, str, list[dict]]:
        self.text += piece
        finished = finish_reason is not None
        if self.plain is None:
            stripped = self.text.lstrip()
            if stripped.startswith(_OPENINGS):
                self.plain = False
            elif finished or stop_prefix_len(stripped, _OPENINGS) != len(stripped):
                self.plain = True
            else:
                return "", "", []
        if self.plain:
            content, self.at = self.text[self.at:], len(self.text)
            return "", content, []
        out = {"reasoning": [], "content": []}
        while True:
            m = _MARKER.search(self.text, self.at)
            end = m.start() if m else len(self.text) - (0 if finished else stop_prefix_len(self.text, MARKERS))
            self._take(self.text[self.at:end], out)
            self.at = end
            if m is None:
                break
            self.at = m.end()
            self._marker(m.group(0))
        if not finished:
            return "".join(out["reasoning"]), "".join(out["content"]), []
        if self.kind == "call" and finish_reason != "stop":  # cut off in a call's body: its text, not a call
            self.kind = "content"
            self._take(self.body, out)
        self._marker("<|end|>")  # the token that ended the reply (<|call|>, <|return|>) is not in the text
        calls = [call(name, arguments(body)) for name, body in self.calls]
        return "".join(out["reasoning"]), "".join(out["content"]), calls if self.parallel else calls[:1]

    def _take(self, text: str, out: dict) -> None:
        if self.kind is None:
            self.header += text
        elif self.kind == "call":
            self.body += text
        elif self.kind != "dropped" and text:
            if self.fresh and self.kind in self.sent:
                out[self.kind].append("\n")
            out[self.kind].append(text)
            self.fresh = False
            self.sent.add(self.kind)

    def _marker(self, marker: str) -> None:
        if marker == "<|message|>" and self.kind is None:
            recipient = _RECIPIENT.search(self.header)
            channel = _CHANNEL.search(self.header)
            if recipient and recipient.group(1).startswith("functions."):
                self.kind = "call" if self.want_calls else "dropped"
            elif recipient or (channel and channel.group(1) == "analysis"):
                self.kind = "reasoning"
            else:
                self.kind = "content"
            self.fresh, self.body = True, ""
        elif marker in ("<|end|>", "<|return|>", "<|call|>", "<|start|>"):
            if self.kind == "call":
                name = _RECIPIENT.search(self.header).group(1).removeprefix("functions.")
                self.calls.append((name, self.body.strip()))
            self.header, self.kind = "", None
        elif self.kind is None:  # <|channel|> and <|constrain|> in a header
            self.header += marker


def split(text: str, calls: bool, parallel: bool = True, finish_reason: str = "stop") \
        -> tuple[str | None, str, list[dict]]:
    """(the reasoning or None, the content, the tool calls) of a whole reply."""
    reasoning, content, found = HarmonyStream(calls, parallel).add(text, finish_reason)
    return reasoning or None, content, found


def arguments(body: str) -> str:
    """A call's arguments as the model wrote them, as compact JSON where they are JSON."""
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except ValueError:
        return body
