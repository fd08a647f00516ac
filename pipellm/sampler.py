"""Token sampling in the last pipeline stage, after each request's logits processors (logits_processors.py):
temperature, top-k/p, min-p, seeded draws; logprobs of the raw logits, before the processors (vLLM's default).

Semantics follow vLLM. After temperature, every filter (top-k, top-p, min-p) is one per-row threshold
on the unnormalised probabilities (tokens tied with the cut-off are kept), so a row without filters is
multiplied by ones and comes out unchanged.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipellm import kernels, structured
from pipellm.logits_processors import RequestProcessors, apply_processors
from pipellm.sampling_params import SamplingParams

_TOP_P_HEAD = 128    # first guess at how many tokens top-p keeps (most rows of a peaked model)
_GREEDY_BELOW = 1e-5  # as vLLM: tinier temperatures are greedy (dividing by them overflows to inf/nan)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None        # under the raw model distribution
    rank: int | None = None             # 1 = most likely raw token
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), descending


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens, each under the raw model distribution at the position before it. R rows."""
    logprobs: np.ndarray             # [R] float32, of each row's next prompt token
    ranks: np.ndarray                # [R] int64, 1 = the most likely token
    top_ids: np.ndarray              # [R, k] int64, the k most likely tokens, descending
    top_logprobs: np.ndarray         # [R, k] float32


VOCAB_ROWS = 64  # rows whose logits over the whole vocabulary exist at once (Gemma 3: 1 MB a row)


def logits_by_rows(compute_logits, hidden: torch.Tensor):
    """(first row, fp32 logits [rows, V]) of hidden [R, hidden], VOCAB_ROWS rows at a time."""
    for start in range(0, len(hidden), VOCAB_ROWS):
        yield start, compute_logits(hidden[start:start + VOCAB_ROWS]).float()


def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """hidden [R, hidden]: the rows before each target [R]; compute_logits: the model's norm + LM head."""
    parts = []
    for start, logits in logits_by_rows(compute_logits, hidden):
        lp = logits.log_softmax(dim=-1)                                                  # [rows, V]
        tok_lp, ranks = _logprob_and_rank(lp, targets[start:start + len(lp)])
        vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        parts.append((tok_lp, ranks, ids, vals))
    tok_lp, ranks, ids, vals = (torch.cat(x) for x in zip(*parts))
    return PromptLogprobs(tok_lp.cpu().numpy(), ranks.cpu().numpy(), ids.cpu().numpy(), vals.cpu().numpy())


def _logprob_and_rank(lp: torch.Tensor, tokens: torch.Tensor, buffer: torch.Tensor | None = None):
    """lp [R, V] log-probabilities, tokens [R] -> each token's log-probability [R] and rank [R] (ties share the
    better rank). Counting via a float 0/1 buffer avoids a slow bool->int64 sum on CPU."""
    tok_lp = lp.gather(1, tokens.unsqueeze(1))
    above = torch.gt(lp, tok_lp, out=buffer if buffer is not None else torch.empty_like(lp))
    return tok_lp.squeeze(1), (above.sum(dim=-1) + 1).long()


class _Request:
    __slots__ = ("params", "seed", "generator", "processors")

    def __init__(self, params: SamplingParams, seed: int, processors: RequestProcessors):
        self.params, self.seed, self.processors = params, seed, processors
        self.generator: torch.Generator | None = None   # made on first draw; on the CPU whatever the logits' device,
        #                                                 so a seed draws the same numbers on a GPU

    @property
    def greedy(self) -> bool:
        return self.params.temperature < _GREEDY_BELOW

    @property
    def gen(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        return self.generator


class _Scratch:
    """Big buffers reused across steps: on CPU a fresh multi-MB tensor page-faults on every step."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, dtype=torch.float32, device=None) -> torch.Tensor:
        numel, device = math.prod(shape), torch.device(device or "cpu")
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


class Sampler:
    def __init__(self, structured_tokenizer: Callable | None = None):
        """structured_tokenizer: () -> llguidance's tokenizer, called on the first request with structured outputs."""
        self._reqs: dict[str, _Request] = {}
        self._scratch = _Scratch()
        self._make_tokenizer, self._tokenizer = structured_tokenizer, None

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int], seed: int,
                    output_token_ids: list[int] = (), min_tokens_stop_ids: list[int] = (),
                    bad_words_token_ids: list[list[int]] = ()) -> None:
        """output_token_ids: tokens this request generated before (in a pipeline that failed). The state is rebuilt
        as if they had been sampled here, so the rest of the output is what it would have been.
        min_tokens_stop_ids: the tokens that would end it (EOS, stop tokens), never drawn before params.min_tokens.
        bad_words_token_ids: params.bad_words as token sequences."""
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} already added")
        matcher = None
        if params.structured_outputs is not None:
            if self._tokenizer is None:
                if self._make_tokenizer is None:
                    raise ValueError("this sampler has no tokenizer for structured outputs")
                self._tokenizer = self._make_tokenizer()
            matcher = structured.Matcher(self._tokenizer, params.structured_outputs)
        req = self._reqs[req_id] = _Request(params, seed, RequestProcessors(
            params, prompt_token_ids, list(min_tokens_stop_ids), [list(w) for w in bad_words_token_ids], matcher))
        for t in output_token_ids:
            req.processors.add_output(t)
            if not req.greedy:  # one uniform per draw, as _draw takes it
                torch.rand(1, generator=req.gen, dtype=torch.float64)

    def remove_request(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def sample(self, logits: torch.Tensor, req_ids: list[str]) -> list[SampledToken]:
        reqs = self._requests(logits, req_ids)
        return self._emit(logits, reqs, self._pick(logits, reqs))

    def plain_greedy_rows(self, req_ids: list[str]) -> list[int]:
        """The rows of req_ids whose requests take their raw logits' largest, with no processors and no logprobs:
        their token ids are all sampling needs (take())."""
        return [i for i, req_id in enumerate(req_ids) if (r := self._reqs[req_id]).greedy
                and not r.processors.is_active and r.params.logprobs is None]

    def take(self, token_ids: torch.Tensor, req_ids: list[str]) -> list[SampledToken]:
        """The tokens of requests plain_greedy_rows() gives, token_ids [rows] their raw logits' first largest."""
        return self._emit(None, [self._reqs[r] for r in req_ids], token_ids)

    def verify(self, logits: torch.Tensor | None, req_ids: list[str], drafts: np.ndarray,
               picks: torch.Tensor | None = None) -> tuple[list[SampledToken], np.ndarray]:
        """Speculative decoding. A request's rows are one for each draft, then its own (req_ids repeats it; drafts
        gives each row's draft, -1 on a request's last row). Each row picks as sample() would, greedy or with the
        next uniform of the request's generator, and a request keeps its drafts up to the first its pick differs
        from. The tokens are those sampling without drafts gives: the same picks, the same draws (the generator
        ends as many draws on as tokens kept). Returns the tokens and the drafts each request kept.
        picks: each row's pick, found by the caller where every row is plain greedy (plain_greedy_rows()), instead
        of logits (None)."""
        reqs = self._requests(logits if picks is None else picks.unsqueeze(1), req_ids)
        drafting = [reqs[i] for i in np.flatnonzero(drafts >= 0).tolist()]
        states = {id(r): r.gen.get_state() for r in drafting if not r.greedy}  # before this call's draws
        picks = self._pick(logits, reqs) if picks is None else picks
        listed = picks.tolist()
        rows, accepted, first = [], [], 0
        for last in np.flatnonzero(drafts == -1).tolist():  # each request's rows: first..last
            kept = 0
            while first + kept < last and listed[first + kept] == drafts[first + kept]:
                kept += 1
            rows.extend(range(first, first + kept + 1))
            accepted.append(kept)
            req = reqs[first]
            if first + kept < last and id(req) in states:  # drew past its last token kept: rewind to one draw a
                req.gen.set_state(states[id(req)])           # token kept, as _draw takes them
                for _ in range(kept + 1):
                    torch.rand(1, generator=req.gen, dtype=torch.float64)
            first = last + 1
        idx = torch.tensor(rows, device=picks.device)
        return (self._emit(None if logits is None else logits[idx], [reqs[i] for i in rows], picks[idx]),
                np.array(accepted, dtype=np.int64))

    def _requests(self, logits: torch.Tensor, req_ids: list[str]) -> list[_Request]:
        if logits.dim() != 2 or logits.shape[0] != len(req_ids):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(req_ids)} request ids")
        return [self._reqs[r] for r in req_ids]

    def _pick(self, logits: torch.Tensor, reqs: list[_Request]) -> torch.Tensor:
        """[rows] each row's token: its request's processors, then greedy or a seeded draw."""
        dev = logits.device
        changed = [i for i, r in enumerate(reqs) if r.processors.is_active]
        if changed or logits.dtype != torch.float32:
            # Processors write in place, so never into the caller's logits.
            x = self._scratch.get("x", logits.shape, device=dev).copy_(logits)
            if changed:
                apply_processors(x, changed, [reqs[i].processors for i in changed])
        else:
            x = logits

        rand_rows = [i for i, r in enumerate(reqs) if not r.greedy]
        if not rand_rows:
            return greedy_ids(x)
        if len(rand_rows) == len(reqs):
            return _sample_random(x, reqs, self._scratch)
        greedy = torch.tensor([i for i, r in enumerate(reqs) if r.greedy], device=dev)
        rand = torch.tensor(rand_rows, device=dev)
        token_ids = torch.empty(len(reqs), dtype=torch.long, device=dev)
        token_ids[greedy] = greedy_ids(x[greedy])
        token_ids[rand] = _sample_random(x[rand], [reqs[i] for i in rand_rows], self._scratch)
        return token_ids

    def _emit(self, logits: torch.Tensor | None, reqs: list[_Request], token_ids: torch.Tensor) -> list[SampledToken]:
        """The picked tokens with the log-probabilities asked for (from logits); each request's processors see its
        tokens."""
        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            ks = [reqs[i].params.logprobs for i in lp_rows]
            _fill_logprobs(out, logits, token_ids, lp_rows, ks, self._scratch)

        for r, t in zip(reqs, ids):
            r.processors.add_output(t)
        return out


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """[rows] each row's first index of its largest value (of its first NaN where it has one)."""
    ops = kernels.for_tensor(x) if x.dtype == torch.float32 and x.is_contiguous() else None
    if ops is not None:  # faster than max on a CPU (16 rows of 49,152 logits on one thread: 108 against 380 us)
        return ops.argmax_rows(x)
    return x.max(dim=-1).indices  # max's indices: argmax's (the first of equal maxima), ~2.7x faster on a CPU


def _sample_random(x: torch.Tensor, reqs: list[_Request], scratch: _Scratch) -> torch.Tensor:
    n, vocab = x.shape
    dev = x.device
    params = [r.params for r in reqs]
    temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    L = torch.div(x, temps, out=scratch.get("w", x.shape, device=dev))
    # Unnormalised probs with the top token at exactly 1; every filter below is "keep w >= threshold".
    w = L.sub_(L.amax(dim=-1, keepdim=True)).exp_()
    keep_min = torch.zeros(n, device=dev)

    head_rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if len(head_rows) == n:
        keep_min = _top_k_top_p_threshold(w, params, scratch)
    elif head_rows:
        idx = torch.tensor(head_rows, device=dev)
        keep_min[idx] = _top_k_top_p_threshold(w[idx], [params[i] for i in head_rows], scratch)
    use_min_p = any(p.min_p > 0 for p in params)
    if use_min_p:
        # p >= min_p * p_max is w >= min_p, since w_max = 1; renormalising after top-k/p changes neither side.
        keep_min = torch.maximum(keep_min, torch.tensor([p.min_p for p in params], device=dev))
    if head_rows or use_min_p:
        # ge into a float buffer, then multiply: several times faster on CPU than a bool mask + where.
        w.mul_(torch.ge(w, keep_min.unsqueeze(1), out=scratch.get("mask", w.shape, device=dev)))
    return _draw(w, [r.gen for r in reqs])


def _draw(weights: torch.Tensor, gens: list[torch.Generator], block: int = 256) -> torch.Tensor:
    """Inverse-CDF draw per row, with one uniform from each row's own generator.

    Two levels (block sums, then one block) instead of a full-vocab cumsum, which is the slowest step on CPU.
    A token of weight 0 can never be drawn.
    """
    n, vocab = weights.shape
    dev = weights.device
    block = min(block, vocab)
    if vocab % block:
        weights = torch.nn.functional.pad(weights, (0, block - vocab % block))
    blocks = weights.view(n, -1, block)
    cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)                      # [n, n_blocks]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(dev)
    target = _below(u * cdf[:, -1], cdf[:, -1]).unsqueeze(1)
    b = torch.searchsorted(cdf, target, right=True)                         # first block whose cdf passes it
    prev = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=dev), b.squeeze(1)].double().cumsum(dim=-1)   # [n, block]
    rest = _below(target - prev, inner[:, -1:])                             # guards sum-vs-cumsum rounding
    return (b * block + torch.searchsorted(inner, rest, right=True)).squeeze(1)


def _below(value: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """value clamped to be strictly below limit (so a right-sided searchsorted stays in range)."""
    return torch.minimum(value, torch.nextafter(limit, torch.zeros_like(limit)))


def _top_k_top_p_threshold(w: torch.Tensor, params: list[SamplingParams], scratch: _Scratch) -> torch.Tensor:
    """Per-row smallest weight kept by top-k then top-p, without sorting whole rows."""
    n, vocab = w.shape
    dev = w.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp_(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    total = w.sum(dim=-1)
    # Top-k rows need exactly their k best; top-p-only rows first try a short head, enough when peaked.
    width = min(vocab, max(p.top_k if p.top_k > 0 else _TOP_P_HEAD for p in params))
    thresh, done = _head_threshold(w.topk(width, dim=-1).values, top_k, top_p, total, vocab)
    if not done.all():
        idx = (~done).nonzero().squeeze(1)
        thresh[idx] = _top_p_radix(w[idx], top_p[idx] * total[idx], scratch)
    return thresh


def _head_threshold(vals, top_k, top_p, total, vocab):
    """Thresholds from each row's descending head `vals` [n, width], and which rows the head sufficed for."""
    width = vals.shape[1]
    has_k = top_k < vocab
    thresh = torch.where(has_k, vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1)).squeeze(1), 0.0)
    use_p = top_p < 1.0
    if not use_p.any():
        return thresh, torch.ones_like(has_k)
    vals_k = vals.masked_fill(torch.arange(width, device=vals.device) >= top_k.unsqueeze(1), 0.0)
    mass = torch.where(has_k, vals_k.sum(dim=-1), total)   # a top-k row's whole mass is in its head
    before = vals_k.cumsum(dim=-1) - vals_k                 # mass strictly above each token
    n_keep = (before < (top_p * mass).unsqueeze(1)).sum(dim=-1).clamp_(min=1)   # the top token always stays
    p_thresh = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    thresh = torch.where(use_p, torch.maximum(thresh, p_thresh), thresh)
    # A top-p-only row that keeps its whole head may have its cut-off further down.
    return thresh, has_k | ~use_p | (n_keep < width) | (width == vocab)


def _top_p_radix(w: torch.Tensor, need: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """Weight of the last token top-p keeps (mass above it < need <= mass down to it), by radix select.

    Non-negative float32 values sort like their int32 bit patterns, so three histogram passes over
    12 + 10 + 9 bits pin the cut-off exactly, in a few full-row passes instead of a sort.
    """
    n, dev = w.shape[0], w.device
    bits = w.view(torch.int32)
    key32 = scratch.get("key32", w.shape, torch.int32, dev)
    key = scratch.get("key", w.shape, torch.long, dev)
    prefix = torch.zeros(n, 1, dtype=torch.int32, device=dev)   # high bits of the cut-off found so far
    need = need.unsqueeze(1)
    for shift, nb in ((19, 12), (9, 10), (0, 9)):
        # Bucket of each token within the current prefix; buckets 0 / 2^nb+1 gather those below / above it.
        torch.bitwise_right_shift(bits, shift, out=key32).sub_(prefix << nb).clamp_(-1, 1 << nb).add_(1)
        key.copy_(key32)  # scatter wants int64 indices
        mass = torch.zeros(n, (1 << nb) + 2, device=dev).scatter_add_(1, key, w)
        from_top = mass.flip(-1).cumsum(dim=-1)
        # First bucket from the top where the mass reaches `need` (clamped against rounding).
        b = ((1 << nb) - (from_top < need).sum(dim=-1, keepdim=True)).clamp_(0, (1 << nb) - 1)
        prefix = (prefix << nb) | b.int()
    return prefix.view(torch.float32).squeeze(1)


def _fill_logprobs(out: list[SampledToken], logits: torch.Tensor, token_ids: torch.Tensor,
                   rows: list[int], ks: list[int], scratch: _Scratch) -> None:
    idx = torch.tensor(rows, device=logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)  # raw logits: no penalties, no temperature (vLLM default)
    tok_lp, ranks = _logprob_and_rank(lp, token_ids[idx], scratch.get("mask", lp.shape, device=lp.device))
    tok_lp, ranks = tok_lp.tolist(), ranks.tolist()
    top = [[] for _ in rows]
    kmax = min(max(ks), lp.shape[1])
    if kmax:
        vals, ids = lp.topk(kmax, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    for j, (i, k) in enumerate(zip(rows, ks)):
        s = out[i]
        s.logprob, s.rank, s.top_logprobs = tok_lp[j], ranks[j], top[j][:k]
