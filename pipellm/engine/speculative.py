"""N-gram speculation (vLLM's "ngram" method): the driver drafts a decoding request's next tokens from its own
context, the stages run them with its next token in one step, and the last stage keeps the drafts up to the first
that differs from its own pick (greedy, or a draw: Sampler.verify), plus that pick."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipellm.sampling_params import SamplingParams


def can_speculate(params: SamplingParams, num_output: int) -> bool:
    """Whether a request's rows can pick their tokens side by side: no processor whose state moves with each token
    (penalties, a grammar, bad words, min_tokens still masking). Temperature, the top-k, top-p and min-p filters,
    logit_bias and allowed_token_ids read each row alone."""
    p = params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not p.bad_words and p.structured_outputs is None and num_output >= p.min_tokens)


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
