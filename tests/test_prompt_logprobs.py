"""SamplingParams(prompt_logprobs=k), as vLLM: each prompt token's log-probability and the top k, equal to HF
transformers' log-softmax of the full sequence's logits, across stages, chunked prefill and cached prefixes."""
import pytest
import torch

from pipellm import LLM, SamplingParams
from tests.conftest import make_checkpoint
from tests.test_families import SHORT, make_family_checkpoint

PROMPT = [(7 * i + 3) % 384 for i in range(40)]  # longer than the 16-token chunks below: prefill in three steps
K = 3


@pytest.fixture(scope="module")
def reference(checkpoints):
    hf_model = checkpoints["llama"][1]
    with torch.no_grad():
        return hf_model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)  # [P, V]: row i scores token i+1


def _assert_matches(prompt_logprobs, reference) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        entry, row = prompt_logprobs[i], reference[i - 1]
        assert entry[PROMPT[i]].logprob == pytest.approx(float(row[PROMPT[i]]), abs=1e-4)
        assert entry[PROMPT[i]].rank == int((row > row[PROMPT[i]]).sum()) + 1
        top = row.topk(K)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[tid].rank == rank and entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        assert set(entry) == set(top.indices.tolist()) | {PROMPT[i]}


@pytest.mark.parametrize("pp,chunk", [(1, None), (2, 16)])
def test_prompt_logprobs_match_hf(llama_dir, reference, pp, chunk):
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    with LLM(llama_dir, pipeline_parallel_size=pp, dtype="float32", **kwargs) as llm:
        plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, temperature=0),
                             use_tqdm=False)[0]
        assert plain.prompt_logprobs is None
        # The plain request left PROMPT's first blocks in the prefix cache: this one must not skip them.
        bm = llm.engine.block_manager
        hits = bm.num_prefix_hits
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
        _assert_matches(out.prompt_logprobs, reference)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert bm.num_prefix_hits == hits
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert bm.num_prefix_hits > hits  # the cache did hold the prefix


def test_bad_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("name,kwargs", [
    ("phi3-longrope", {}),  # the prompt fits the short factors; its output grows past them and is recomputed
    ("llama", {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 44}),  # preempted and recomputed
])
def test_a_recomputed_prompt_keeps_its_first_scores(tmp_path, name, kwargs):
    """As a model given only the prompt scores it: HF's log-softmax of the prompt alone."""
    hf = (make_checkpoint if name == "llama" else make_family_checkpoint)(name, str(tmp_path))
    prompts = [PROMPT[:SHORT - 8], PROMPT[8:SHORT], PROMPT[5:SHORT - 4]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=1)
    with LLM(str(tmp_path), dtype="float32", **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        recomputed = llm.engine.scheduler.num_preemptions if name == "llama" else 1
    assert recomputed > 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert got == pytest.approx([float(want[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-4)
