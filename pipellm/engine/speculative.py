"""N-gram speculation (vLLM's "ngram" method): the driver drafts a decoding request's next tokens from its own
context, the stage runs them with its next token as one chunk, and the last stage keeps the drafts the model itself
picks (greedy), plus the token it picks after the last one kept."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipellm.sampler import GREEDY_BELOW
from pipellm.sampling_params import SamplingParams


def can_speculate(params: SamplingParams, num_output: int) -> bool:
    """Whether a request's drafts can be verified by the model's greedy pick alone: greedy, and no processor whose
    state moves with each token (penalties, grammar, bad words, min_tokens still masking) or that changes the pick."""
    p = params
    return (p.temperature < GREEDY_BELOW and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words
            and p.structured_outputs is None and num_output >= p.min_tokens)


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed, earlier in tokens, the longest n-gram (n_min <= n <= n_max) that also ends
    tokens; the latest such match. [] where even the last n_min tokens occur nowhere before."""
    size = len(tokens)
    if size <= n_min:
        return []
    windows = sliding_window_view(tokens[:size - 1], n_min)                     # [size - n_min, n_min]
    ends = np.flatnonzero((windows == tokens[size - n_min:]).all(axis=1)) + n_min  # just past each match
    for n in range(n_min, n_max):  # lengthen the matches one token back, while any is left
        longer = ends[ends > n]
        longer = longer[tokens[longer - n - 1] == tokens[size - n - 1]]
        if not len(longer):
            break
        ends = longer
    if not len(ends):
        return []
    return tokens[ends[-1]:ends[-1] + k].tolist()
