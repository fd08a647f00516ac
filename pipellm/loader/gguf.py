"""Convert a llama.cpp GGUF file into an HF-style model folder (config, float32 safetensors, tokenizer)."""
import hashlib
import logging
import os
import re
import shutil
import tempfile

import numpy as np

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (HF class, model_type, whether llama.cpp permuted the Q/K rows).
# llama.cpp writes Mistral models as "llama"; "mistral" is accepted in case a file says so.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_CACHE_FORMAT = 1  # part of the cache key: bump it when the converted output changes
_MISSING = object()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (rotary pairs interleaved per head) back to HF's rotate-half order."""
    rows, cols = w.shape
    # per head, llama.cpp rows are [rows/n_head/2, 2] (pairs interleaved); HF rows are [2, rows/n_head/2] (two halves)
    # [rows, cols] -> [n_head, rows/n_head/2, 2, cols] -> [n_head, 2, rows/n_head/2, cols] -> [rows, cols]
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _open(path: str):
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # the reader fails with ValueError/IndexError/... on truncated or foreign files
        raise ValueError(f"{path}: not a valid GGUF file, or truncated ({type(e).__name__}: {e})") from e


def _meta(reader, path: str, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"{path}: GGUF metadata {key} is missing")
        return default
    return field.contents()


def _f32(x: float) -> float:
    # GGUF stores float32; take its shortest repr so 1e-5 stays 1e-5 rather than 9.999999747e-06
    return float(str(np.float32(x)))


def _hf_config(reader, path: str) -> tuple[str, dict]:
    """(GGUF architecture, HF config fields)."""
    arch = _meta(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    hf_class, model_type, _ = ARCHITECTURES[arch]

    def m(key, default=_MISSING):
        return _meta(reader, path, f"{arch}.{key}", default)

    scaling = m("rope.scaling.type", "none")
    if scaling != "none" or m("rope.scale_linear", 1.0) != 1.0:
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (only plain RoPE)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: Llama 3 rope scaling (tensor rope_freqs.weight) is not supported")

    hidden, heads = m("embedding_length"), m("attention.head_count")
    head_dim = m("attention.key_length", hidden // heads)
    if m("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count={m('rope.dimension_count')}, "
                         f"head_dim={head_dim}) is not supported")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{path}: tensor token_embd.weight is missing")
    cfg = {
        "architectures": [hf_class],
        "vocab_size": int(embed.shape[-1]),  # GGUF dims are innermost first: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(m("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": m("context_length"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, path, "tokenizer.ggml.eos_token_id", None),
        "torch_dtype": "float32",
    }
    if model_type == "mistral":  # llama.cpp attends to the whole context unless the file says otherwise
        cfg["sliding_window"] = m("attention.sliding_window", None)
    return arch, cfg


def _expected_shapes(cfg: dict, qkv_bias: bool) -> dict:
    h, v, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.fullmatch(name)
    if match and match[2] in _BLOCK_NAMES:
        return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"
    return None


def _tensors(reader, path: str, cfg: dict, permuted: bool, qkv_bias: bool) -> dict:
    from gguf.quants import dequantize

    expected = _expected_shapes(cfg, qkv_bias)
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name not in expected:
            raise ValueError(f"{path}: unexpected tensor {t.name} for this architecture")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, "
                             "which gguf cannot dequantize") from None
        # t.shape lists dims innermost first ([in, out]); HF wants [out, in]
        w = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape))), dtype=np.float32)
        if w.shape != expected[name]:
            raise ValueError(f"{path}: tensor {t.name} has shape {list(w.shape)}, expected {list(expected[name])}")
        if permuted and t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif permuted and t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[name] = w
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing, e.g. {missing[0]}")
    return out


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = os.path.abspath(gguf_path)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists")
    reader = _open(path)
    arch, cfg = _hf_config(reader, path)
    _, model_type, permuted = ARCHITECTURES[arch]
    tensors = _tensors(reader, path, cfg, permuted, qkv_bias=model_type == "qwen2")

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # build next to out_dir and rename at the end, so a crash never leaves a half-written folder
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        AutoConfig.for_model(model_type, **cfg).save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"]).save_pretrained(tmp)
        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot build the tokenizer from its metadata ({type(e).__name__}: {e})") from e
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cached_gguf_folder(gguf_path: str, cache_dir: str | None = None) -> str:
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    cache_dir = cache_dir or os.environ.get("PIPELLM_CACHE_DIR") or os.path.join("~", ".cache", "pipellm")
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    folder = os.path.join(cache_dir, "gguf", f"{_sha256(gguf_path)}-v{_CACHE_FORMAT}")
    if os.path.isdir(folder):  # folders appear only by atomic rename, so one that exists is complete
        return folder
    logger.info("converting %s to %s (once; later starts reuse it)", gguf_path, folder)
    try:
        convert_gguf(gguf_path, folder)
    except OSError:  # another process may have finished the same conversion first
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
    return folder
