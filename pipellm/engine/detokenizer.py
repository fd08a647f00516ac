"""A completion's text as its tokens come. Each update decodes only a short window of the newest tokens (vLLM's
prefix and read offsets), not the whole output, so a long generation costs O(tokens), not O(tokens^2). The engine
keeps one per completion that has stop strings or streams, and LLM's outputs and the server's streamed text both
come from it."""
from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # the text of token_ids[:read_offset]
        # token_ids[prefix_offset:read_offset] decoded again as the context of the tokens after them: a token's text
        # can depend on its neighbours (a leading space, a character spread over several byte tokens)
        self.prefix_offset = self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Adds tokens; returns the text they complete. Text that ends in an incomplete UTF-8 sequence (U+FFFD) waits
        for the tokens that complete it, unless final."""
        self.token_ids.extend(new_token_ids)
        if self.read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(window) <= len(prefix) or window.endswith("\ufffd")):
            return ""
        delta = window[len(prefix):]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta


class StreamText:
    """A completion's text as its client sees it: the engine's text deltas, less any tail that could still grow into
    a stop string (the engine cuts the text there if it does). The streamed text adds up to the final text exactly."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.num_sent_chars = 0

    def add(self, text: str, finished: bool, stop_text: str | None = None) -> str:
        self.text = stop_text if stop_text is not None else self.text + text
        end = len(self.text) if finished else len(self.text) - stop_prefix_len(self.text, self.stops)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return delta


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
