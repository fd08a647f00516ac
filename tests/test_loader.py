"""Model folders: what is refused, and errors that name the file and the problem."""
import json
import shutil
from copy import deepcopy

import pytest
import torch

from pipellm import LLM
from pipellm.model_config import ModelConfig


@pytest.fixture
def model_copy(tmp_path, llama_dir):
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    return folder


def test_pickle_checkpoints_are_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"only pickle checkpoints found \(pytorch_model\.bin\).*refused"):
        LLM(str(model_copy))


def test_pickle_file_as_model_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="pickle checkpoints such as .bin/.pt are refused"):
        LLM(str(path))


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(model_copy))


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LLM(str(model_copy))


def test_corrupt_safetensors_names_the_file(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        LLM(str(model_copy))


def test_unknown_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: architecture \['FancyNewForCausalLM'\] is not supported"):
        LLM(str(model_copy))


def test_wrong_shape_names_the_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d+\.mlp\.\w+_proj\.weight has shape"):
        LLM(str(model_copy))


def test_sharded_checkpoint_loads_the_same(tmp_path, checkpoints):
    from pipellm import SamplingParams

    folder, hf = checkpoints["llama"]
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", sharded / f)
    assert (sharded / "model.safetensors.index.json").exists()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    with LLM(folder) as a, LLM(str(sharded), pipeline_parallel_size=2) as b:
        assert a.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
            b.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_config_fields(checkpoints):
    qwen = ModelConfig.from_pretrained(checkpoints["qwen2"][0])
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    mistral = ModelConfig.from_pretrained(checkpoints["mistral"][0])
    assert mistral.sliding_window == 24 and mistral.head_dim == 32
    gpt2 = ModelConfig.from_pretrained(checkpoints["gpt2"][0])
    assert gpt2.is_gpt2 and gpt2.intermediate_size == 4 * gpt2.hidden_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_only_looked_up_stays_in_the_file(tmp_path, checkpoints, dtype):
    from pipellm import SamplingParams

    folder, hf = checkpoints["qwen2"]  # tied: the last stage holds the table for its LM head, the first looks it up
    copy = tmp_path / "copy"
    deepcopy(hf).to(dtype).save_pretrained(copy)  # the session's model stays as the other tests compare with it
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", copy / f)
    table = hf.model.embed_tokens.weight
    name = {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    ids = {}
    for pp, quantization in ((1, None), (2, None), (2, "int8")):
        with LLM(str(copy), pipeline_parallel_size=pp, dtype="float32", quantization=quantization) as llm:
            held = [dict(r.weight_bytes) for r in llm.engine.inspect()]
            ids[pp, quantization] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        mapped = [h.get(f"{name} file-mapped") for h in held]
        if pp == 2 and quantization is None:  # the first stage's table is the file's; the last holds its own
            assert mapped == [table.numel() * dtype.itemsize, None] and held[1]["F32"] >= table.numel() * 4
        else:  # one stage holds it for its LM head; quantization rounds the table on every stage alike
            assert mapped == [None] * pp
    assert ids[1, None] == ids[2, None]
