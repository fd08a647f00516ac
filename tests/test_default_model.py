"""The default model (SmolLM2-135M-Instruct from its GGUF) against HF transformers' golden greedy outputs."""
import json
import os

import pytest

from pipellm import LLM, SamplingParams

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "data", "smollm2_greedy_golden.json")))["cases"]


@pytest.fixture(scope="module")
def greedy_ids(smollm2_dir):
    """pipeline size -> greedy ids for every golden prompt."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in GOLDEN]
    out = {}
    for pp in (1, 2):
        with LLM(smollm2_dir, pipeline_parallel_size=pp) as llm:
            out[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return out


def test_same_ids_for_one_and_two_stages(greedy_ids):
    assert greedy_ids[1] == greedy_ids[2]


@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_matches_hf_golden(greedy_ids, case):
    assert greedy_ids[2][case] == GOLDEN[case]["greedy_token_ids"]


def test_default_model_says_paris(smollm2_dir):
    with LLM(pipeline_parallel_size=2) as llm:  # model=None: the default model
        assert [s for s in llm.describe_stages()] == ["stage 0: embed + layers 0-14",
                                                      "stage 1: layers 15-29 + norm + lm_head"]
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0.0),
                           use_tqdm=False)[0]
        assert out.prompt_token_ids == GOLDEN[0]["prompt_token_ids"]
        assert "Paris" in out.outputs[0].text
        chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
        assert "Paris" in chat.outputs[0].text
        assert chat.outputs[0].finish_reason == "stop"  # stopped at <|im_end|>
