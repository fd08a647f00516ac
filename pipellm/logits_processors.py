"""A request's own settings applied to its logits before sampling, as vLLM's logits processors: the grammar's mask
(structured outputs), allowed_token_ids, bad_words, logit_bias and the stop tokens min_tokens holds back, then the
repetition, frequency and presence penalties. Each request keeps its state here (the last stage's sampler holds it)
and advances it with every token sampled for it."""
import torch

from pipellm import structured
from pipellm.sampling_params import SamplingParams


class _History:
    """What penalties read: a request's distinct prompt+output token ids, with their output counts.

    Kept sparse (CPU tensors with spare room), so penalties cost O(distinct tokens), not O(vocab).
    """

    def __init__(self, prompt_ids: list[int]):
        distinct = list(dict.fromkeys(prompt_ids))
        self.pos = {t: i for i, t in enumerate(distinct)}
        self.n = len(distinct)
        self.ids = torch.zeros(max(64, 2 * self.n), dtype=torch.long)
        self.ids[:self.n] = torch.tensor(distinct, dtype=torch.long)
        self.counts = torch.zeros(len(self.ids))   # output occurrences; 0 for prompt-only tokens

    def add(self, token: int) -> None:
        i = self.pos.get(token)
        if i is None:
            if self.n == len(self.ids):
                self.ids = torch.cat([self.ids, torch.zeros_like(self.ids)])
                self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            i = self.pos[token] = self.n
            self.ids[i] = token
            self.n += 1
        self.counts[i] += 1


class RequestProcessors:
    """One request's processors, and the state they keep: what a grammar, bad words, min_tokens and the penalties
    read of the tokens sampled so far."""
    __slots__ = ("params", "num_output", "stop_ids", "bias_ids", "bias", "matcher", "allowed", "bad_words",
                 "tail_len", "tail", "history")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], min_tokens_stop_ids: list[int],
                 bad_words: list[list[int]], matcher: structured.Matcher | None = None):
        self.params = params
        self.num_output = 0                             # tokens sampled for it so far
        self.stop_ids = torch.tensor(min_tokens_stop_ids, dtype=torch.long)   # masked before min_tokens
        bias = params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.matcher = matcher                          # its place in its grammar (structured outputs)
        self.allowed = None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids)
        self.bad_words = bad_words                      # token sequences whose last token never completes them
        self.tail_len = max(map(len, bad_words), default=1) - 1  # the tokens a bad word's last token may follow
        self.tail = list(prompt_ids[-self.tail_len:]) if self.tail_len else []  # the last of prompt + output
        p = params
        penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self.history = _History(prompt_ids) if penalized else None

    @property
    def masks_stops(self) -> bool:
        return self.num_output < self.params.min_tokens and len(self.stop_ids) > 0

    @property
    def is_active(self) -> bool:
        return (self.history is not None or len(self.bias_ids) > 0 or self.masks_stops or self.matcher is not None
                or self.allowed is not None or bool(self.bad_words))

    def add_output(self, token: int) -> None:
        self.num_output += 1
        if self.history is not None:
            self.history.add(token)
        if self.matcher is not None:
            self.matcher.consume(token)
        if self.tail_len:
            self.tail = (self.tail + [token])[-self.tail_len:]


def apply_processors(x: torch.Tensor, rows: list[int], reqs: list[RequestProcessors]) -> None:
    """Each row's processors, in place on x [R, V]: the grammar's mask, allowed_token_ids, bad_words, logit_bias
    and (before min_tokens) the stop tokens at -inf first, as vLLM, so that the penalties see their result."""
    for i, r in zip(rows, reqs):
        if r.matcher is not None:
            x[i].masked_fill_(~r.matcher.allowed(x.shape[1]).to(x.device), float("-inf"))
        if r.allowed is not None:
            keep = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
            keep[r.allowed.to(x.device)] = True
            x[i].masked_fill_(~keep, float("-inf"))
        if r.bad_words:  # a word's last token, where the tokens before it end the text so far
            banned = [w[-1] for w in r.bad_words if w[:-1] == r.tail[len(r.tail) - len(w) + 1:]]
            x[i, banned] = float("-inf")
        if len(r.bias_ids):  # ids below the vocabulary size: the engine checked them
            x[i, r.bias_ids.to(x.device)] += r.bias.to(x.device)
        if r.masks_stops:
            x[i, r.stop_ids.to(x.device)] = float("-inf")
    penalized = [(i, r) for i, r in zip(rows, reqs) if r.history is not None]
    if penalized:
        _apply_penalties(x, *map(list, zip(*penalized)))


def _apply_penalties(x: torch.Tensor, rows: list[int], reqs: list[RequestProcessors]) -> None:
    hists = [r.history for r in reqs]
    lengths = torch.tensor([h.n for h in hists])
    which = torch.repeat_interleave(torch.arange(len(reqs)), lengths)   # request of each (row, token) entry
    row = torch.tensor(rows)[which]
    ids = torch.cat([h.ids[:h.n] for h in hists])
    counts = torch.cat([h.counts[:h.n] for h in hists])
    inside = ids < x.shape[1]
    if not inside.all():  # prompt ids the logits don't cover
        which, row, ids, counts = which[inside], row[inside], ids[inside], counts[inside]
    rep, freq, pres = torch.tensor(
        [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in reqs]
    )[which].to(x.device).unbind(1)
    row, ids, counts = row.to(x.device), ids.to(x.device), counts.to(x.device)

    vals = x[row, ids]
    # Repetition: every listed token is in the prompt or output; pushes either sign toward "less likely".
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    # Frequency/presence: output tokens only (prompt-only tokens have count 0), as in OpenAI/vLLM.
    vals -= freq * counts + pres * (counts > 0)
    x[row, ids] = vals
