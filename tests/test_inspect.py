"""LLM.inspect and `pipellm inspect`: the logit lens and each layer's attention, against HF transformers' own hidden
states and attention weights, the same at every pipeline size."""
import json

import numpy as np
import pytest
import torch

from pipellm import LLM
from pipellm.entrypoints.cli import main as cli_main
from pipellm.observe.inspect import DPI, kv_size, lens_size, save_inspect

PROMPT = [5, 17, 42, 99, 7, 256, 31, 8, 77, 12, 150, 3, 64, 200, 9, 11, 45, 88, 120, 33, 2, 190, 70, 14, 6, 301,
          18, 55, 91, 240]  # 30 tokens: past the Mistral checkpoint's window of 24, and over one 16-token block


def hf_reference(hf_model, prompt: list[int]) -> dict:
    """From HF's own forward pass: each layer's top token and its probability (final norm + head on its hidden
    state), the greedy next token, and that token's attention per KV head (query heads of a group averaged)."""
    with torch.no_grad():
        first = hf_model(torch.tensor([prompt]))
        next_id = int(first.logits[0, -1].argmax())
        out = hf_model(torch.tensor([prompt + [next_id]]), output_hidden_states=True, output_attentions=True)
    body = hf_model.transformer if hasattr(hf_model, "transformer") else hf_model.model
    final_norm = body.ln_f if hasattr(body, "ln_f") else body.norm
    head = hf_model.get_output_embeddings()
    num_layers = len(out.attentions)
    probs = []
    with torch.no_grad():
        for i in range(num_layers):  # HF's last hidden state has the final norm applied already
            logits = out.logits[0] if i == num_layers - 1 else head(final_norm(out.hidden_states[i + 1][0]))
            cap = getattr(hf_model.config, "final_logit_softcapping", None)
            if cap is not None and i < num_layers - 1:  # HF's logits have it already
                logits = torch.tanh(logits / cap) * cap
            probs.append(torch.softmax(logits[:len(prompt)].float(), -1))
    kv_heads = getattr(hf_model.config, "num_key_value_heads", None) or hf_model.config.num_attention_heads
    attention = [a[0, :, -1].reshape(kv_heads, -1, len(prompt) + 1).mean(1) for a in out.attentions]  # [KV, K]
    return {"next_id": next_id, "probs": probs, "attention": attention}


def assert_matches_hf(data: dict, ref: dict, num_layers: int) -> None:
    assert data["next_token_id"] == ref["next_id"]
    assert len(data["layers"]) == num_layers
    for layer, probs in zip(data["layers"], ref["probs"]):
        top = probs.max(-1)
        assert layer["top_token_ids"] == top.indices.tolist(), layer["layer"]
        np.testing.assert_allclose(layer["top_probs"], top.values.numpy(), atol=1e-4)
        assert layer["next_token_prob"] == pytest.approx(float(probs[-1, ref["next_id"]]), abs=1e-4)
        np.testing.assert_allclose(layer["attention"], ref["attention"][layer["layer"]].numpy(), atol=1e-4)
    assert data["layers"][-1]["top_token_ids"][-1] == data["next_token_id"]


@pytest.mark.parametrize("arch,pp,partition,chunk", [
    ("llama", 2, None, None),
    ("mistral", 3, [1, 3, 1], 16),  # sliding window, chunked prefill: the lens is stitched from two steps
    ("gpt2", 2, [4, 1], None),
])
def test_lens_and_attention_match_hf(checkpoints, arch, pp, partition, chunk):
    folder, hf_model = checkpoints[arch]
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    with LLM(folder, pipeline_parallel_size=pp, layer_partition=partition, dtype="float32", **kwargs) as llm:
        data = llm.inspect({"prompt_token_ids": PROMPT})
        again = llm.inspect({"prompt_token_ids": PROMPT})  # its full block is cached now: still every position
    assert_matches_hf(data, hf_reference(hf_model, PROMPT), hf_model.config.num_hidden_layers)
    for a, b in zip(again["layers"], data["layers"]):  # same values, wherever its blocks lie now
        assert {k: v for k, v in a.items() if k != "kv_blocks"} == {k: v for k, v in b.items() if k != "kv_blocks"}
    for layer in data["layers"]:
        attention = np.array(layer["attention"])
        assert attention.shape[1] == len(PROMPT) + 1  # the prompt and the fed-back token: nothing later
        np.testing.assert_allclose(attention.sum(-1), 1, atol=1e-5)
        assert len(layer["kv_key_rms"]) == len(PROMPT) + 1 and len(layer["kv_blocks"]) == 2
    if arch == "mistral":  # the window of 24 keys ends at the new token: the first 7 positions get nothing
        assert all(np.array(layer["attention"])[:, :7].max() == 0 for layer in data["layers"])


def test_gemma2_soft_capping_matches_hf(tmp_path):
    """Soft-capped attention scores and logits, and Gemma's norms, through the lens and the attention weights."""
    from tests.test_families import make_family_checkpoint
    hf_model = make_family_checkpoint("gemma2", str(tmp_path))
    with LLM(str(tmp_path), pipeline_parallel_size=2, dtype="float32") as llm:
        data = llm.inspect({"prompt_token_ids": PROMPT})
    assert_matches_hf(data, hf_reference(hf_model, PROMPT), hf_model.config.num_hidden_layers)


@pytest.fixture(scope="module")
def default_model_data(smollm2_dir):
    out = {}
    for pp in (1, 2):
        with LLM(smollm2_dir, pipeline_parallel_size=pp) as llm:
            out[pp] = llm.inspect("The capital of France is")
            out[pp, "greedy"] = llm.generate("The capital of France is", _greedy_one(), use_tqdm=False)[0]
    return out


def _greedy_one():
    from pipellm import SamplingParams
    return SamplingParams(temperature=0, max_tokens=1)


def test_default_model_at_pp1_and_pp2(default_model_data):
    one, two = default_model_data[1], default_model_data[2]
    assert [s["first_layer"] for s in two["stages"]] == [0, 15] and len(one["stages"]) == 1
    for data in (one, two):
        assert [l["layer"] for l in data["layers"]] == list(range(30))
        assert [l["stage"] for l in data["layers"]] == [0 if len(data["stages"]) == 1 or i < 15 else 1
                                                        for i in range(30)]
        assert data["layers"][-1]["top_tokens"][-1] == data["next_token"] == " Paris"
        assert data["next_token_id"] == default_model_data[1, "greedy"].outputs[0].token_ids[0]
    for a, b in zip(one["layers"], two["layers"]):
        assert a["top_tokens"] == b["top_tokens"] and a["kv_blocks"] == b["kv_blocks"]
        for key in ("top_probs", "attention", "kv_key_rms"):
            np.testing.assert_allclose(a[key], b[key], atol=1e-4)
        assert a["next_token_prob"] == pytest.approx(b["next_token_prob"], abs=1e-4)


def test_pictures_and_json(default_model_data, tmp_path):
    from matplotlib.image import imread
    data = default_model_data[2]
    paths = save_inspect(data, str(tmp_path))
    assert json.load(open(paths["inspect.json"])) == data
    num_layers, num_keys = len(data["layers"]), len(data["cached_tokens"])
    for name, (w, h) in (("lens.png", lens_size(num_layers, len(data["prompt_tokens"]))),
                         ("kv.png", kv_size(num_layers, num_keys, 3, 15))):
        image = imread(paths[name])
        assert image.shape[:2] == (round(h * DPI), round(w * DPI)), name
        assert image[..., :3].std() > 0.1, f"{name} is blank"


def test_cli_writes_pictures_and_summary(llama_dir, tmp_path, capsys):
    cli_main(["inspect", llama_dir, "-pp", "2", "--prompt", "The capital of France is", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "stage 0: layers 0-2" in out and "stage 1: layers 3-4" in out
    assert {p.name for p in tmp_path.iterdir()} == {"inspect.json", "lens.png", "kv.png"}


def test_bad_prompts_leave_the_engine_usable(llm_pp2):
    with pytest.raises(ValueError, match="empty"):
        llm_pp2.inspect({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="max_model_len"):
        llm_pp2.inspect({"prompt_token_ids": [1] * (llm_pp2.engine.max_model_len - 1)})
    assert len(llm_pp2.inspect({"prompt_token_ids": [1, 2, 3]})["layers"]) == 5
