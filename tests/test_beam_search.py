"""LLM.beam_search, as vLLM's: the beams equal HF transformers' beam search, and their log-probabilities HF's."""
import json
import os
import shutil

import pytest
import torch

from pipellm import LLM
from pipellm.beam_search import BeamSearch
from pipellm.outputs import Logprob
from pipellm.sampling_params import BeamSearchParams
from tests.conftest import FP32

PROMPTS = [[(7 * i + 3) % 384 for i in range(12)], [(5 * i + 11) % 384 for i in range(21)]]


def _hf_logprob(hf, prompt: list[int], tokens: list[int]) -> float:
    """The generated tokens' log-probability, from one forward pass."""
    with torch.no_grad():
        lp = hf(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    return lp.gather(-1, torch.tensor(tokens[len(prompt):])[:, None]).sum().item()


@pytest.mark.parametrize("pp", [1, 2])
def test_beams_equal_hf(checkpoints, pp):
    folder, hf = checkpoints["llama"]
    width, new = 3, 6
    with LLM(folder, pipeline_parallel_size=pp, dtype=FP32) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                               BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))
        tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                               max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0).tolist()
        assert [s.tokens for s in out.sequences] == want
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([_hf_logprob(hf, prompt, w) for w in want],
                                                                       abs=1e-4)
        assert all(len(s.logprobs) == new and s.finish_reason == "length" for s in out.sequences)
        assert [s.text for s in out.sequences] == [tok.decode(s.tokens) for s in out.sequences]


def test_a_beam_ends_at_eos(checkpoints, tmp_path):
    folder, hf = checkpoints["llama"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    eos = 38  # the second token of PROMPTS[0]'s best beams with EOS ignored: here it ends them
    with open(os.path.join(tmp_path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [0, eos]}, f)
    with LLM(str(tmp_path), dtype=FP32) as llm:
        [out] = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=3, max_tokens=6))
    assert any(s.finish_reason == "stop" for s in out.sequences)
    for s in out.sequences:
        new = s.tokens[len(PROMPTS[0]):]
        assert (s.finish_reason == "stop") == (new[-1] == eos) and eos not in new[:-1]
        assert len(new) == 6 or s.finish_reason == "stop"
        assert s.cum_logprob == pytest.approx(_hf_logprob(hf, PROMPTS[0], s.tokens), abs=1e-4)


def test_beam_search_errors(llm_pp2):
    with pytest.raises(ValueError, match="beam_width=11 ranks the top 22 log-probabilities a step, more than the "
                                         "engine's max_logprobs=20: start it with max_logprobs=22"):
        llm_pp2.beam_search(["Hello"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match=r"BeamSearchParams.beam_width=0: must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    for prompt, why in (("", "the prompt is empty"), ({"prompt_token_ids": [5] * 300}, "the prompt has 300 tokens")):
        with pytest.raises(ValueError, match=why):
            llm_pp2.beam_search(["Hello", prompt], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(llm_pp2.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences) == 2


def test_a_wider_step_ranks_the_same_candidates():
    """A step widened to report more log-probabilities (a server's logprobs=k) still grows each beam from its top
    2 * beam_width and the token it drew, as vLLM's: an EOS ranked past them ends no beam."""
    eos = 9
    entry = {5: Logprob(-0.5, 1), 6: Logprob(-1.0, 2), eos: Logprob(-1.5, 3), 7: Logprob(-2.0, 4)}
    for logprobs, drawn, done in ((0, 5, []), (4, 5, []), (4, eos, [[1, 2, eos]])):
        search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=1), {eos}, 64, 20, logprobs)
        assert search.step_params.logprobs == max(2, logprobs)
        search.advance(search.live(), [entry], [drawn])
        assert [s.tokens for s in search.done[0]] == done
        assert [s.tokens for s in search.beams[0]] == [[1, 2, 5]]
