import math
import pickle

import pytest
import torch

from pipellm import kernels
from pipellm.sampler import SampledToken, Sampler
from pipellm.sampling_params import SamplingParams as SP
from tests.test_quant import ISAS


def make(params_list, prompts=None, seeds=None):
    s = Sampler()
    ids = [f"r{i}" for i in range(len(params_list))]
    for i, p in enumerate(params_list):
        s.add_request(ids[i], p, prompts[i] if prompts else [], seeds[i] if seeds else i)
    return s, ids


def draw_many(logits_row, params, n, seed0=0, batch=1000):
    """n draws from the same row: up to `batch` requests with distinct seeds, over several steps."""
    batch = min(n, batch)
    assert n % batch == 0
    s, ids = make([params] * batch, seeds=[seed0 + i for i in range(batch)])
    rows = logits_row.expand(batch, -1)
    return torch.tensor([t.token_id for _ in range(n // batch) for t in s.sample(rows, ids)])


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# --- greedy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_including_ties(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[2, 10] = logits[2, 500] = 50.0           # tie: argmax picks the first
    logits[3] = 0.0                                  # all tied
    s, ids = make([SP(temperature=0.0)] * 6)
    got = [t.token_id for t in s.sample(logits, ids)]
    assert got == logits.float().argmax(dim=-1).tolist()
    assert got[2] == 10 and got[3] == 0


@pytest.mark.skipif(kernels.load() is None, reason="the kernels did not build here")
@pytest.mark.parametrize("vocab", [1, 7, 16, 23, 4099])
def test_greedy_kernel_picks_as_torch_max_for_every_instruction_set(vocab):
    """Greedy picks on a CPU come from our kernel (ops.argmax_rows): the first of tied maxima, the first NaN,
    rows all -inf, maxima in the vector part and in the tail, on each instruction set this CPU runs."""
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1] = 0.5                                          # all tied
    logits[2, vocab // 2] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 1e9                                      # the last (in the tail when vocab % 16)
    logits[5, 0] = logits[5, -1] = 1e9
    logits[6, -1], logits[6, vocab // 3] = float("nan"), float("nan")
    logits[7, vocab // 2] = float("inf")
    expected = logits.max(dim=-1).indices
    for isa in ISAS:
        assert torch.equal(kernels.load().argmax_rows(logits, isa), expected), isa


def test_greedy_rows_in_mixed_batch_stay_argmax():
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(1))
    params = [SP(temperature=0.0) if i % 2 else SP(temperature=1.5, top_p=0.9) for i in range(8)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert [out[i].token_id for i in range(1, 8, 2)] == logits[1::2].argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy():
    # Dividing by 1e-40 would overflow to inf and produce nan probabilities.
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(9)) * 5
    s, ids = make([SP(temperature=1e-40), SP(temperature=1e-40, top_p=0.5), SP(temperature=0.0),
                   SP(temperature=1e-40, min_p=0.5)])
    assert [t.token_id for t in s.sample(logits, ids)] == logits.argmax(dim=-1).tolist()


def test_caller_logits_not_modified():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SP(temperature=0.7, repetition_penalty=1.3, presence_penalty=1.0, top_k=5),
              SP(temperature=0.0, frequency_penalty=2.0), SP(temperature=1.0, min_p=0.1)]
    s, ids = make(params, prompts=[list(range(50))] * 3)
    for _ in range(3):
        s.sample(logits, ids)
    assert torch.equal(logits, before)


# --- seeding ------------------------------------------------------------------------------------

def run_steps(sampler, logits_seq, ids):
    return [[t.token_id for t in sampler.sample(lg, ids)] for lg in logits_seq]


def test_same_seed_same_tokens_across_samplers():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(4, 2000, generator=g) for _ in range(10)]
    params = [SP(temperature=1.0), SP(temperature=0.8, top_k=50), SP(top_p=0.9), SP(min_p=0.05)]
    s1, ids = make(params, seeds=[11, 12, 13, 14])
    s2, _ = make(params, seeds=[11, 12, 13, 14])
    assert run_steps(s1, steps, ids) == run_steps(s2, steps, ids)


@pytest.mark.parametrize("mine", [
    SP(temperature=0.9, top_p=0.8, top_k=200, min_p=0.01),
    SP(temperature=1.2, top_p=0.8),   # flat rows: top-p keeps hundreds of tokens
])
def test_seeded_tokens_independent_of_batch_mates_and_order(mine):
    g = torch.Generator().manual_seed(4)
    V = 3000
    row_steps = [torch.randn(V, generator=g) for _ in range(15)]

    alone = Sampler()
    alone.add_request("me", mine, [1, 2, 3], seed=1234)
    ref = [alone.sample(r.unsqueeze(0), ["me"])[0].token_id for r in row_steps]

    # Same request, now in the middle of a batch whose other rows use other options
    # (a wider top-k head, top-p only, greedy, penalties) and whose order changes every step.
    others = [SP(temperature=1.0, top_k=1000), SP(top_p=0.99), SP(temperature=0.0), SP(repetition_penalty=1.5)]
    batch = Sampler()
    batch.add_request("me", mine, [1, 2, 3], seed=1234)
    for i, p in enumerate(others):
        batch.add_request(f"o{i}", p, [5], seed=i)
    got = []
    for step, r in enumerate(row_steps):
        order = ["me"] + [f"o{i}" for i in range(len(others))]
        order = order[step % 5:] + order[:step % 5]
        rows = torch.stack([r if rid == "me" else torch.randn(V, generator=g) for rid in order])
        out = batch.sample(rows, order)
        got.append(out[order.index("me")].token_id)
    assert got == ref


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: 20 identical draws by chance is impossible in practice
    seqs = []
    for seed in (1, 2):
        s = Sampler()
        s.add_request("r", SP(temperature=1.0), [], seed)
        seqs.append([s.sample(logits, ["r"])[0].token_id for _ in range(20)])
    assert seqs[0] != seqs[1]
    assert len(set(seqs[0])) > 10


# --- filtering ----------------------------------------------------------------------------------

def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(5)) * 3
    greedy = logits.argmax(dim=-1).tolist()
    for p in (SP(temperature=2.0, top_k=1), SP(temperature=2.0, top_p=1e-6)):
        s, ids = make([p] * 16, seeds=list(range(100, 116)))
        assert [t.token_id for t in s.sample(logits, ids)] == greedy


PROBS4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("params, support", [
    (SP(top_k=2), {0, 1}),
    (SP(top_k=3), {0, 1, 2}),
    (SP(top_p=0.75), {0, 1}),               # 0.5 < 0.75 <= 0.8
    (SP(top_p=0.85), {0, 1, 2}),            # 0.8 < 0.85 <= 0.95
    (SP(top_p=0.97), {0, 1, 2, 3}),
    (SP(min_p=0.2), {0, 1, 2}),             # drop p < 0.1
    (SP(min_p=0.5), {0, 1}),                # drop p < 0.25
    (SP(top_k=3, min_p=0.5), {0, 1}),
    (SP(top_k=3, top_p=0.6), {0, 1}),       # top-p over the top-3 renormalised: 0.53 < 0.6
])
def test_filters_give_expected_support(params, support):
    # Shuffle the vocabulary so support isn't just "the first ids".
    perm = torch.tensor([2, 0, 3, 1])
    row = torch.empty(4)
    row[perm] = PROBS4.log()
    drawn = draw_many(row, params, 3000)
    assert set(drawn.tolist()) == {int(perm[i]) for i in support}


def top_p_reference(row, top_p, top_k=None):
    probs = torch.softmax(row.double(), dim=-1)
    vals, idx = probs.sort(descending=True)
    if top_k:
        vals, idx = vals[:top_k] / vals[:top_k].sum(), idx[:top_k]
    before = vals.cumsum(0) - vals
    return set(idx[before < top_p].tolist())


@pytest.mark.parametrize("params", [SP(top_p=0.65), SP(top_p=0.7, top_k=300), SP(top_p=0.8, temperature=0.5)])
def test_top_p_large_kept_set_matches_sorted_reference(params):
    row = torch.randn(400, generator=torch.Generator().manual_seed(10)) * 0.5
    top_k = params.top_k if params.top_k > 0 else None
    expected = top_p_reference(row / params.temperature, params.top_p, top_k)
    assert 150 < len(expected) < 300  # many tokens kept (past the sampler's first short head), many dropped
    drawn = set(draw_many(row, params, 10000, seed0=5, batch=2000).tolist())
    assert drawn == expected


def test_temperature_sampling_matches_softmax():
    g = torch.Generator().manual_seed(6)
    row = torch.randn(8, generator=g) * 1.5
    n = 20000
    for temp in (0.7, 1.0, 1.6):
        counts = torch.bincount(draw_many(row, SP(temperature=temp), n, seed0=7), minlength=8).double()
        probs = torch.softmax(row.double() / temp, dim=-1)
        # df = 7: P(chi2 > 40) ~ 1e-6; seeded, so this cannot flake.
        assert chi_square(counts, probs) < 40, (temp, counts, probs * n)


def test_filtered_distribution_is_renormalised_and_unfiltered_rows_untouched():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    n = 8000
    # Half the rows use top_k=2, half use nothing: the latter must keep the full distribution.
    s, ids = make([SP(top_k=2) if i % 2 else SP() for i in range(2 * n)], seeds=list(range(2 * n)))
    toks = torch.tensor([t.token_id for t in s.sample(row.expand(2 * n, -1), ids)])
    plain = torch.bincount(toks[0::2], minlength=4).double()
    topk = torch.bincount(toks[1::2], minlength=4).double()
    assert chi_square(plain, row.exp().double()) < 35                          # df = 3
    assert topk[2:].sum() == 0
    assert chi_square(topk[:2], torch.tensor([4 / 7, 3 / 7], dtype=torch.float64)) < 30  # df = 1


def test_large_vocab_draw_respects_masked_tokens_and_block_edges():
    # Vocab not a multiple of the internal block size; live tokens sit on block boundaries.
    V = 1000
    live = torch.tensor([0, 255, 256, 511, 700, 999])
    w = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 1.0])
    row = torch.full((V,), -math.inf)
    row[live] = w.log()
    toks = draw_many(row, SP(), 12000, seed0=99)
    assert set(toks.tolist()) <= set(live.tolist())
    counts = torch.bincount(toks, minlength=V)[live].double()
    assert chi_square(counts, (w / w.sum()).double()) < 40  # df = 5


# --- penalties ----------------------------------------------------------------------------------

def greedy_seq(params, row, prompt, steps):
    s = Sampler()
    s.add_request("r", params, prompt, 0)
    return [s.sample(row.unsqueeze(0), ["r"])[0].token_id for _ in range(steps)]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    row = torch.tensor([2.0, 1.9, -5.0])
    assert greedy_seq(SP(temperature=0.0, repetition_penalty=1.1), row, [0], 1) == [1]   # 2/1.1 < 1.9
    assert greedy_seq(SP(temperature=0.0), row, [0], 1) == [0]
    neg = torch.tensor([-1.0, -1.05, -5.0])
    # multiplied: -1.1 < -1.05, so token 1 wins; dividing would have kept token 0
    assert greedy_seq(SP(temperature=0.0, repetition_penalty=1.1), neg, [0], 1) == [1]


def test_repetition_penalty_covers_output_tokens():
    row = torch.tensor([2.0, 1.9, 1.8])
    # no prompt overlap: 0 first, then 0 is penalised -> 1, then both -> 2, then all seen -> 0
    assert greedy_seq(SP(temperature=0.0, repetition_penalty=1.5), row, [7], 4) == [0, 1, 2, 0]


def test_presence_penalty_output_only_and_once():
    row = torch.tensor([1.0, 0.8, 0.0])
    # prompt token 0 is not penalised; after output, 0 loses 0.5 once (not per occurrence)
    assert greedy_seq(SP(temperature=0.0, presence_penalty=0.5), row, [0, 0, 0], 4) == [0, 1, 0, 0]


def test_frequency_penalty_scales_with_count():
    row = torch.tensor([1.0, 0.8, 0.0])
    # 0 -> 0.85 > 0.8 -> 0 -> 0.7 < 0.8 -> 1 -> (0.7 vs 0.65) -> 0
    assert greedy_seq(SP(temperature=0.0, frequency_penalty=0.15), row, [0], 4) == [0, 0, 1, 0]


def test_presence_penalty_history_grows_over_many_distinct_tokens():
    # Flat logits: each greedy step takes the lowest id not yet generated; once all 150 are used
    # they are all penalised equally (presence counts once), so 0 wins from then on.
    seq = greedy_seq(SP(temperature=0.0, presence_penalty=2.0), torch.zeros(150), [], 152)
    assert seq == list(range(150)) + [0, 0]


def test_penalties_only_touch_their_own_rows():
    row = torch.tensor([1.0, 0.8, 0.0])
    s, ids = make([SP(temperature=0.0, presence_penalty=2.0), SP(temperature=0.0)])
    seqs = [[t.token_id for t in s.sample(row.expand(2, -1), ids)] for _ in range(3)]
    assert [x[0] for x in seqs] == [0, 1, 2]
    assert [x[1] for x in seqs] == [0, 0, 0]


# --- min_tokens and logit_bias -----------------------------------------------------------------

def test_min_tokens_keeps_stop_ids_out_counting_tokens_from_before_a_restart():
    logits = torch.zeros(2, 10)
    logits[:, 3], logits[:, 9], logits[:, 5] = 5.0, 4.0, 3.0    # the stop ids 3 and 9 lead, then 5
    s = Sampler()
    # min_tokens=4 with one token generated before a restart: three more draws without 3 or 9.
    s.add_request("a", SP(temperature=0.0, min_tokens=4), [], 0, [7], min_tokens_stop_ids=[3, 9])
    s.add_request("b", SP(temperature=0.0), [], 1)
    got = [[t.token_id for t in s.sample(logits, ["a", "b"])] for _ in range(4)]
    assert got == [[5, 3], [5, 3], [5, 3], [3, 3]]
    assert logits[0, 3] == 5.0   # the caller's logits untouched
    # Drawn: the masked tokens never come up, even at high temperature.
    s.add_request("c", SP(temperature=5.0, min_tokens=50, max_tokens=None, seed=1), [], 2, min_tokens_stop_ids=[3, 9])
    drawn = {s.sample(logits[:1], ["c"])[0].token_id for _ in range(49)}
    assert not drawn & {3, 9} and len(drawn) > 3


def test_logit_bias_moves_greedy_and_drawn_tokens_in_its_own_row_only():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]] * 2)
    s, ids = make([SP(temperature=0.0, logit_bias={0: -1.5, 2: 1.2}), SP(temperature=0.0)])
    assert [t.token_id for t in s.sample(logits, ids)] == [2, 0]   # 0.5 + 1.2 beats 2.0 - 1.5 and 1.0
    # +100 on one token: every draw takes it; -100 on the leader: it is never drawn.
    tokens = draw_many(logits[0], SP(temperature=1.0, logit_bias={3: 100.0}), 200)
    assert set(tokens.tolist()) == {3}
    tokens = draw_many(logits[0], SP(temperature=1.0, logit_bias={0: -100.0}), 1000)
    assert 0 not in tokens.tolist() and set(tokens.tolist()) == {1, 2, 3}


def test_bad_words_ban_the_token_that_would_complete_them_also_after_a_restart():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 4] = 5.0, 4.0          # greedy: 3, then 3 again unless banned
    s = Sampler()
    s.add_request("a", SP(temperature=0.0), [1, 2], 0, bad_words_token_ids=[[3, 3], [2, 4, 4]])
    assert [s.sample(logits, ["a"])[0].token_id for _ in range(3)] == [3, 4, 3]  # 3 3 banned; 4 then 3 fine
    # After a restart: 4 was generated after the prompt's 2, so 4 would complete "2 4 4"; 9 is a one-token word.
    s.add_request("b", SP(temperature=0.0), [2], 1, [4], bad_words_token_ids=[[2, 4, 4], [9]])
    logits[0, 4], logits[0, 9] = 6.0, 9.0
    assert [s.sample(logits, ["b"])[0].token_id for _ in range(2)] == [3, 4]


# --- logprobs -----------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)) * 2
    params = [SP(temperature=0.6, logprobs=5, repetition_penalty=2.0),
              SP(temperature=0.0, logprobs=0, presence_penalty=2.0),
              SP(temperature=1.3, top_k=40),
              SP(temperature=0.0, logprobs=3)]
    s, ids = make(params, prompts=[list(range(0, 300, 2))] * 4)
    lp = torch.log_softmax(logits, dim=-1)
    for _ in range(3):  # later steps have penalties active; logprobs must still be raw
        out = s.sample(logits, ids)
        for i in (0, 1, 3):
            t = out[i]
            assert t.logprob == pytest.approx(lp[i, t.token_id].item(), abs=1e-5)
            assert t.rank == 1 + int((lp[i] > lp[i, t.token_id]).sum())
        assert out[1].top_logprobs == []
        assert out[2].logprob is None and out[2].rank is None and out[2].top_logprobs is None
        assert out[3].rank == 1
        for i, k in ((0, 5), (3, 3)):
            top = out[i].top_logprobs
            vals, idx = lp[i].topk(k)
            assert [tid for tid, _ in top] == idx.tolist()
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-5)
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_sampled_token_is_picklable():
    s, ids = make([SP(temperature=0.0, logprobs=2)])
    tok = s.sample(torch.tensor([[0.0, 1.0, 2.0]]), ids)[0]
    back = pickle.loads(pickle.dumps(tok))
    assert isinstance(back, SampledToken) and back == tok and back.token_id == 2


# --- request lifecycle --------------------------------------------------------------------------

def test_remove_request_frees_state():
    row = torch.tensor([[1.0, 0.8, 0.0]])
    s = Sampler()
    s.add_request("a", SP(temperature=0.0, presence_penalty=0.5), [], 0)
    assert s.has_request("a") and len(s) == 1
    assert [s.sample(row, ["a"])[0].token_id for _ in range(2)] == [0, 1]
    s.remove_request("a")
    assert not s.has_request("a") and len(s) == 0
    with pytest.raises(KeyError):
        s.sample(row, ["a"])
    # Re-adding the id starts from a clean history: no penalty carried over.
    s.add_request("a", SP(temperature=0.0, presence_penalty=0.5), [], 0)
    assert s.sample(row, ["a"])[0].token_id == 0


def test_duplicate_add_and_shape_mismatch_rejected():
    s, ids = make([SP()])
    with pytest.raises(ValueError):
        s.add_request(ids[0], SP(), [], 0)
    with pytest.raises(ValueError):
        s.sample(torch.zeros(2, 5), ids)
