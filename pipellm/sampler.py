"""Token sampling for the last pipeline stage: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Semantics follow vLLM. Filtering is expressed as one keep-threshold per row on the tempered logits
(keep L >= T), so rows without an option get T = -big and come out unchanged.
"""
import math
from dataclasses import dataclass

import torch

from pipellm.sampling_params import SamplingParams

_NO_LIMIT = torch.finfo(torch.float32).min  # threshold that keeps every finite logit
_GREEDY_BELOW = 1e-5  # as vLLM: tinier temperatures are greedy (dividing by them overflows to inf/nan)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None        # under the raw model distribution
    rank: int | None = None             # 1 = most likely raw token
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), descending


class _Request:
    __slots__ = ("params", "prompt_ids", "seed", "generator", "prompt_mask", "counts")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], seed: int):
        self.params = params
        self.prompt_ids = list(prompt_ids) if self.penalized else []  # only repetition penalty reads it
        self.seed = seed
        self.generator: torch.Generator | None = None   # made on first draw, on the logits' device
        self.prompt_mask: torch.Tensor | None = None    # [V] bool, made on first penalized step
        self.counts: torch.Tensor | None = None         # [V] float32 output-token counts, penalized requests only

    @property
    def greedy(self) -> bool:
        return self.params.temperature < _GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def gen(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def penalty_state(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:  # first step of this request: no output yet
            self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = torch.tensor([t for t in self.prompt_ids if 0 <= t < vocab], dtype=torch.long)
            self.prompt_mask[ids.to(device)] = True
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return self.prompt_mask, self.counts


class Sampler:
    def __init__(self):
        self._reqs: dict[str, _Request] = {}

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int], seed: int) -> None:
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} already added")
        self._reqs[req_id] = _Request(params, prompt_token_ids, seed)

    def remove_request(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def sample(self, logits: torch.Tensor, req_ids: list[str]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(req_ids):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(req_ids)} request ids")
        reqs = [self._reqs[r] for r in req_ids]
        dev = logits.device

        pen_rows = [i for i, r in enumerate(reqs) if r.penalized]
        if pen_rows:
            x = logits.to(torch.float32, copy=True)  # penalties write in place; never touch the caller's logits
            _apply_penalties(x, pen_rows, [reqs[i] for i in pen_rows])
        else:
            x = logits.float()

        rand_rows = [i for i, r in enumerate(reqs) if not r.greedy]
        if not rand_rows:
            token_ids = x.argmax(dim=-1)
        elif len(rand_rows) == len(reqs):
            token_ids = _sample_random(x, reqs)
        else:
            greedy = torch.tensor([i for i, r in enumerate(reqs) if r.greedy], device=dev)
            rand = torch.tensor(rand_rows, device=dev)
            token_ids = torch.empty(len(reqs), dtype=torch.long, device=dev)
            token_ids[greedy] = x[greedy].argmax(dim=-1)
            token_ids[rand] = _sample_random(x[rand], [reqs[i] for i in rand_rows])

        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            _fill_logprobs(out, logits, token_ids, lp_rows, [reqs[i].params.logprobs for i in lp_rows])

        for r, t in zip(reqs, ids):  # output history, kept only where a penalty reads it
            if r.counts is not None:
                r.counts[t] += 1
        return out


def _apply_penalties(x: torch.Tensor, rows: list[int], reqs: list[_Request]) -> None:
    vocab, dev = x.shape[1], x.device
    states = [r.penalty_state(vocab, dev) for r in reqs]
    prompt_mask = torch.stack([s[0] for s in states])
    counts = torch.stack([s[1] for s in states])

    def col(vals):
        return torch.tensor(vals, dtype=torch.float32, device=dev).unsqueeze(1)

    rep = col([r.params.repetition_penalty for r in reqs])
    freq = col([r.params.frequency_penalty for r in reqs])
    pres = col([r.params.presence_penalty for r in reqs])
    idx = torch.tensor(rows, device=dev)
    sub = x[idx]
    in_output = counts > 0
    # Repetition: seen anywhere (prompt or output); pushes positive and negative logits toward "less likely".
    sub = torch.where(prompt_mask | in_output, torch.where(sub > 0, sub / rep, sub * rep), sub)
    # Frequency/presence: output tokens only, as in OpenAI/vLLM.
    sub -= freq * counts + pres * in_output
    x[idx] = sub


def _sample_random(x: torch.Tensor, reqs: list[_Request]) -> torch.Tensor:
    n, vocab = x.shape
    dev = x.device
    params = [r.params for r in reqs]
    L = x / torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    keep_min = torch.full((n,), _NO_LIMIT, device=dev)

    head_rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if head_rows:
        if len(head_rows) == n:
            keep_min = _top_k_top_p_threshold(L, params)
        else:
            idx = torch.tensor(head_rows, device=dev)
            keep_min[idx] = _top_k_top_p_threshold(L[idx], [params[i] for i in head_rows])

    row_max = L.amax(dim=-1)
    use_min_p = any(p.min_p > 0 for p in params)
    if use_min_p:
        # p / p_max >= min_p  <=>  L >= L_max + log(min_p); renormalisation after top-k/p cancels out.
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=dev)
        keep_min = torch.maximum(keep_min, row_max + log_min_p)

    keep = L >= keep_min.unsqueeze(1) if head_rows or use_min_p else None
    weights = L.sub_(row_max.unsqueeze(1)).exp_()  # unnormalised probs, in place: L is our own tensor
    if keep is not None:
        weights.mul_(keep)
    return _draw(weights, [r.gen(dev) for r in reqs])


def _draw(weights: torch.Tensor, gens: list[torch.Generator], block: int = 256) -> torch.Tensor:
    """Inverse-CDF draw per row, with one uniform from each row's own generator.

    Two levels (block sums, then one block) instead of a full-vocab cumsum, which is the slowest step on CPU.
    A token of weight 0 can never be drawn.
    """
    n, vocab = weights.shape
    dev = weights.device
    if vocab % block:
        weights = torch.nn.functional.pad(weights, (0, block - vocab % block))
    blocks = weights.view(n, -1, block)
    cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)                      # [n, n_blocks]
    u = torch.cat([torch.rand(1, generator=g, device=dev, dtype=torch.float64) for g in gens])
    target = _below(u * cdf[:, -1], cdf[:, -1]).unsqueeze(1)
    b = torch.searchsorted(cdf, target, right=True)                         # first block whose cdf passes target
    prev = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=dev), b.squeeze(1)].double().cumsum(dim=-1)   # [n, block]
    rest = _below(target - prev, inner[:, -1:])                             # guards sum-vs-cumsum rounding
    return (b * block + torch.searchsorted(inner, rest, right=True)).squeeze(1)


def _below(value: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """value clamped to be strictly below limit (so a right-sided searchsorted stays in range)."""
    return torch.minimum(value, torch.nextafter(limit, torch.zeros_like(limit)))


def _top_k_top_p_threshold(L: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per-row minimum logit kept by top-k then top-p, computed from the sorted head of each row only."""
    n, vocab = L.shape
    dev = L.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp_(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    has_k = top_k < vocab
    p_only = ~has_k & (top_p < 1.0)
    lse_full = None
    if any(p.top_k <= 0 and p.top_p < 1.0 for p in params):
        # Tokens with p < (1-top_p)/V are always dropped (their total mass is < 1-top_p and they sort
        # last), so only the tokens above that bound need sorting.
        lse_full = L.logsumexp(dim=-1)
        bound = torch.where(p_only, lse_full + torch.log((1.0 - top_p) / vocab), math.inf)
        head = torch.where(p_only, (L >= bound.unsqueeze(1)).sum(dim=-1).clamp_(min=1), top_k)
    else:
        head = top_k
    width = int(head.max())
    vals = L.topk(width, dim=-1).values                                     # [n, width], descending
    pos = torch.arange(width, device=dev)
    vals_k = vals.masked_fill(pos >= top_k.unsqueeze(1), -math.inf)        # top-k applied to the head
    kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1)).squeeze(1)
    thresh = torch.where(has_k, kth, _NO_LIMIT)

    if any(p.top_p < 1.0 for p in params):
        # Normaliser: the top-k rows' whole mass is in the head; other rows need the full row.
        lse = vals_k.logsumexp(dim=-1)
        if lse_full is not None:
            lse = torch.where(has_k, lse, lse_full)
        probs = (vals_k - lse.unsqueeze(1)).exp()
        before = probs.cumsum(dim=-1) - probs                               # mass strictly above each token
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)    # the top token always stays
        p_thresh = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        thresh = torch.where(top_p < 1.0, torch.maximum(thresh, p_thresh), thresh)
    return thresh


def _fill_logprobs(out: list[SampledToken], logits: torch.Tensor, token_ids: torch.Tensor,
                   rows: list[int], ks: list[int]) -> None:
    idx = torch.tensor(rows, device=logits.device)
    lp = logits[idx].float().log_softmax(dim=-1)  # raw logits: no penalties, no temperature (vLLM default)
    tok = token_ids[idx].unsqueeze(1)
    tok_lp = lp.gather(1, tok)
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()  # ties share the better rank
    tok_lp = tok_lp.squeeze(1).tolist()
    top = [[] for _ in rows]
    kmax = min(max(ks), lp.shape[1])
    if kmax:
        vals, ids = lp.topk(kmax, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    for j, (i, k) in enumerate(zip(rows, ks)):
        s = out[i]
        s.logprob, s.rank, s.top_logprobs = tok_lp[j], ranks[j], top[j][:k]
