"""N-gram speculative decoding (speculative_config): greedy output equals HF transformers' token for token while drafts
are kept and thrown away, at PP=1 and PP=2; seeded sampling draws the same tokens as without drafts; requests that
cannot speculate are untouched; stops, max_tokens, the prefix cache and preemption hold."""
import numpy as np
import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.engine.sequence import Request
from pipellm.engine.speculative import propose
from tests.conftest import FP32, make_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2, 7, 1, 5, 9], [7, 3], [3, 4, 5, 6, 7, 8, 9, 10] * 3]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A random llama over 24 tokens: its greedy output repeats itself, so n-gram drafts are often right."""
    folder = str(tmp_path_factory.mktemp("spec"))
    return folder, make_checkpoint("llama", folder, vocab_size=24)


def hf_argmax_ids(model, prompt: list[int], n: int) -> list[int]:
    """HF's forward, its top token appended n times (no EOS rule: the engine runs with ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_propose_finds_the_latest_longest_match():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40)))
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 3))
        expected = []
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):  # a plain search, longest n first
            starts = [i for i in range(len(tokens) - n) if (tokens[i:i + n] == tokens[len(tokens) - n:]).all()]
            if starts:
                expected = tokens[starts[-1] + n:starts[-1] + n + 3].tolist()
                break
        assert propose(tokens, 3, n_min, n_max) == expected, (tokens.tolist(), n_min, n_max)


def test_a_requests_token_array_grows_with_its_outputs():
    """The drafts search prompt + output as one int64 array, kept and grown a few tokens a step (past its room
    too), never stale."""
    req = Request("r", [5, 6, 7], SamplingParams(), seed=0, max_tokens=100)
    rng = np.random.default_rng(1)
    for _ in range(60):
        req.output_token_ids.extend(rng.integers(0, 9, size=int(rng.integers(0, 4))).tolist())
        arr = req.token_array()
        assert arr.dtype == np.int64 and arr.tolist() == req.prompt_token_ids + req.output_token_ids
    del req.output_token_ids[10:]  # cut back: built again
    assert req.token_array().tolist() == req.prompt_token_ids + req.output_token_ids


@pytest.mark.parametrize("pp", [1, 2])
def test_greedy_output_equals_hf_with_drafts_kept_and_dropped(small_vocab, pp):
    folder, hf = small_vocab
    expected = [hf_argmax_ids(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(folder, pipeline_parallel_size=pp, dtype=FP32, speculative_config=SPEC) as llm:
        assert generate(llm, PROMPTS, GREEDY) == expected
        engine = llm.engine
        assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens  # some kept, some thrown away
        assert engine.num_generated_tokens == GREEDY.max_tokens * len(PROMPTS)


def test_sampled_requests_draw_what_they_draw_without_drafts(small_vocab):
    """A seeded draw per row, the generator rewound to one draw a token kept: the same tokens as without drafts,
    with temperature, top-k/top-p/min-p, logit_bias and allowed_token_ids."""
    folder, _ = small_vocab
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=4, top_p=0.9, min_p=0.05, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.5, seed=9, logit_bias={3: 2.0},
                             allowed_token_ids=list(range(3, 20)), ignore_eos=True)]
    runs = []
    for spec in (None, SPEC):
        with LLM(folder, dtype=FP32, speculative_config=spec) as llm:
            runs.append(generate(llm, PROMPTS, params))
            kept = llm.engine.num_accepted_tokens
    assert runs[0] == runs[1] and kept > 0
    assert all(3 <= t < 20 for t in runs[1][2])


def test_requests_that_cannot_speculate_are_untouched(small_vocab):
    folder, _ = small_vocab
    params = [SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, min_tokens=30)]
    runs = []
    for spec in (None, SPEC):
        with LLM(folder, dtype=FP32, speculative_config=spec) as llm:
            runs.append(generate(llm, PROMPTS, params))
            assert llm.engine.num_draft_tokens == 0
    assert runs[0] == runs[1]


def test_stop_tokens_and_max_tokens_cut_drafts(small_vocab):
    folder, hf = small_vocab
    reference = hf_argmax_ids(hf, PROMPTS[0], 40)
    stop = reference[20]  # ends the output at its first occurrence, wherever a step's drafts put it
    cut = reference[:reference.index(stop) + 1]
    with LLM(folder, dtype=FP32, speculative_config=SPEC) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2,
                           [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
                            SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)], use_tqdm=False)
        assert llm.engine.num_accepted_tokens > 0
    assert out[0].outputs[0].token_ids == cut and out[0].outputs[0].finish_reason == "stop"
    assert out[1].outputs[0].token_ids == reference[:23] and out[1].outputs[0].finish_reason == "length"


def test_prefix_cache_and_preemption_with_drafts(small_vocab):
    folder, hf = small_vocab
    prompts = PROMPTS + PROMPTS[:1]  # the last one's prompt blocks come from the cache
    expected = [hf_argmax_ids(hf, p, 36) for p in prompts]
    # 16 blocks of 4 tokens: one sequence of 64 fits, four of ~50 do not (preemption)
    with LLM(folder, dtype=FP32, block_size=4, num_kv_blocks=16, max_model_len=64, speculative_config=SPEC) as llm:
        out = generate(llm, prompts, SamplingParams(max_tokens=36, temperature=0, ignore_eos=True))
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_accepted_tokens > 0
    assert out == expected


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, 'method=\'eagle\': pipellm speculates by n-gram lookup only'),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0: must be an integer from 1 to 64"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "must be at most prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown field(s) lookahead"),
    ("ngram", "give a dict such as"),
])
def test_bad_speculative_configs_say_what_to_change(small_vocab, spec, message):
    with pytest.raises(ValueError) as e:
        LLM(small_vocab[0], speculative_config=spec)
    assert message in str(e.value)


def test_speculation_excludes_the_other_ways_of_running_ahead(small_vocab):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(small_vocab[0], async_scheduling=True, distributed_executor_backend="mp", speculative_config=SPEC)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(small_vocab[0], num_scheduler_steps=4, speculative_config=SPEC)


def test_a_restart_mid_speculation_gives_the_tokens_of_a_fault_free_run(small_vocab):
    """The last stage dies with drafts out: the new pipeline replays each request's draws, one a token kept."""
    from tests.test_recovery import KillWhen

    prompts = [p[i % len(p):] + p[:i % len(p)] for i, p in enumerate(PROMPTS * 5)]
    params = [SamplingParams(max_tokens=40, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(small_vocab[0], pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32,
             speculative_config=SPEC) as llm:
        expected = generate(llm, prompts, params)
        killer = KillWhen(llm, 1)
        killer.start()
        got = generate(llm, prompts, params)
        killer.stop.set()
        assert killer.killed_at is not None and 0 < max(killer.progress) < 40, "the kill did not land mid-generation"
        assert len(llm.engine.restarts) == 1 and llm.engine.num_accepted_tokens > 0
    assert got == expected
