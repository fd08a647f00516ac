"""Reasoning in chat completions, as vLLM's `--reasoning-parser`: a thinking model's thought comes back as the
message's `reasoning_content`, the rest as its `content` (where tool calls are then looked for). The thought starts
the output: with qwen3 where the output opens with <think> (thinking on), with deepseek_r1 always (its template opens
the tag); it ends at </think>, or with the output. openai_gptoss reads GPT-OSS's harmony channels (harmony.py)."""
from pipellm.engine.detokenizer import stop_prefix_len

PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
_START, _END = "<think>", "</think>"


def split(text: str, parser: str) -> tuple[str | None, str]:
    """(the thought or None, the content)."""
    stripped = text.lstrip()
    if stripped.startswith(_START):
        text = stripped[len(_START):]
    elif parser != "deepseek_r1":
        return None, text
    reasoning, _, content = text.partition(_END)
    return reasoning, content.lstrip("\n")


class ReasoningStream:
    """split() as the pieces come: each piece's (reasoning, content) deltas. A tail that could begin a tag, and the
    newlines after the thought, wait for the next piece."""

    def __init__(self, parser: str):
        self.parser, self.text = parser, ""
        self.in_thought: bool | None = None  # unknown until the output's start shows it
        self.thought_sent = self.content_from = self.content_sent = 0

    def add(self, piece: str, finished: bool) -> tuple[str, str]:
        self.text += piece
        if self.in_thought is None:
            stripped = self.text.lstrip()
            if stripped.startswith(_START):
                self.in_thought, self.thought_sent = True, len(self.text) - len(stripped) + len(_START)
            elif _START.startswith(stripped) and not finished:
                return "", ""  # may still open with <think>
            else:
                self.in_thought = self.parser == "deepseek_r1"
        reasoning = ""
        if self.in_thought:
            at = self.text.find(_END, self.thought_sent)
            end = at if at != -1 else len(self.text) - (0 if finished else stop_prefix_len(self.text, [_END]))
            reasoning, self.thought_sent = self.text[self.thought_sent:end], max(self.thought_sent, end)
            if at == -1:
                return reasoning, ""
            self.in_thought, self.content_from = False, at + len(_END)
        content = self.text[self.content_from:]
        if self.content_from:  # after a thought: without the newlines that follow its end tag
            content = content.lstrip("\n")
            if not content and not finished:
                return reasoning, ""
        delta, self.content_sent = content[self.content_sent:], len(content)
        return reasoning, delta
