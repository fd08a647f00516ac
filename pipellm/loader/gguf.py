"""llama.cpp GGUF files: their metadata as an HF-style folder (config, tokenizer), and each stage's own tensors
read straight from the file into compact weights (quant/), never widened to fp32 on disk or in memory."""
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import tempfile

import numpy as np
import torch
from torch import nn

from pipellm.loader.gguf_names import (BLOCK_INDEX, HYBRID, NEMOTRON, ROPE_TENSORS, expected_shapes, grouped_v_heads,
                                       hf_config, hf_name, stored_as, undo)

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 4  # part of the cache key: bump it when the converted output changes
SOURCE_FILE = "gguf.json"  # in a cached folder: which GGUF file holds the weights
TABLE_FILE = "gguf_tensors.json"  # and where each tensor lies in it
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


def _hf_config(reader, path: str) -> tuple[str, tuple, dict]:
    def meta(key, default=KeyError):
        return _meta(reader, path, key, _MISSING if default is KeyError else default)

    tensors = {t.name: ([int(d) for d in reversed(t.shape)],  # GGUF lists dims innermost first
                        _dequantize(t, path).tolist() if t.name in ROPE_TENSORS else None) for t in reader.tensors}
    return hf_config(meta, tensors, path)


def _entries(reader, path: str, arch: str, cfg: dict):
    """(tensor, HF name, shape, expert or None) for every weight, experts one by one; checks that every tensor the
    architecture needs is there with its shape (from the header; no data is read)."""
    expected = expected_shapes(cfg, split_kv_b=any(t.name.endswith(".attn_k_b.weight") for t in reader.tensors),
                               fused_qkvz=any(t.name.endswith(".ssm_in.weight") for t in reader.tensors),
                               fused_qkv=arch == "phi2" and any(t.name.endswith(".attn_qkv.weight")
                                                                for t in reader.tensors))
    seen = set()
    for t in reader.tensors:
        block = BLOCK_INDEX.match(t.name)
        mtp = arch in ("glm4moe", "deepseek2", "exaone-moe") + HYBRID + NEMOTRON and block \
            and int(block[1]) >= cfg["num_hidden_layers"]
        if t.name in ROPE_TENSORS or mtp:  # the multi-token prediction layer after the last: left unread
            continue
        name = hf_name(t.name, arch)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first ([in, out])
        # (HF name, its slice of the tensor's rows in equal parts): stacked experts one by one
        fused = name is not None and name.endswith(".gate_up_proj.weight")
        if name is None or "{e}" not in name:
            parts = [(name, None)]
        elif fused:  # Mistral 4's: each expert's gate rows, then its up rows
            parts = [(name.format(e=e).replace("gate_up_proj", proj), 2 * e + i) for e in range(shape[0])
                     for i, proj in enumerate(("gate_proj", "up_proj"))]
        else:
            parts = [(name.format(e=e), e) for e in range(shape[0])]
        for full, part in parts:
            if full not in expected:
                raise ValueError(f"{path}: unexpected tensor {t.name} for this architecture")
            want = expected[full] if part is None else (shape[0], (1 + fused) * expected[full][0],
                                                        *expected[full][1:])
            # [h] for HF's [1, h]; a vector held as a matrix (Mamba-2's group norm, [groups, width / groups])
            if shape != want and [d for d in shape if d != 1] != [d for d in want if d != 1] and not (
                    len(want) == 1 and math.prod(shape) == want[0]):
                raise ValueError(f"{path}: tensor {t.name} has shape {list(shape)}, expected {list(want)}")
            seen.add(full)
            yield t, full, expected[full], part
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing, e.g. {missing[0]}")


def _dequantize(t, path: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, "
                         "which gguf cannot dequantize") from None


def _tensors(reader, path: str, arch: str, cfg: dict, permuted: bool) -> dict:
    out, values = {}, {}
    heads = _unpermute_heads(cfg, permuted)
    for t, name, shape, expert in list(_entries(reader, path, arch, cfg)):
        if t.name not in values:
            values = {t.name: _dequantize(t, path)}  # one tensor (all its experts) at a time
        w = values[t.name].reshape(-1, *shape)[expert or 0]
        if heads.get(t.name.split(".")[-2]):
            w = unpermute_qk(w, heads[t.name.split(".")[-2]])
        w = undo(stored_as(arch, t.name), w)
        if cfg.get("linear_heads_tiled"):  # HF's grouped value heads, for transformers
            w = grouped_v_heads(name, w, cfg)
        out[name] = np.ascontiguousarray(w)
    for k_name in [n for n in out if n.endswith(".self_attn.k_b_proj.weight")]:  # llama.cpp's split, as HF's
        k = out.pop(k_name).transpose(0, 2, 1)                                       # [heads, nope, rank]
        v = out.pop(k_name.replace(".k_b_proj.", ".v_b_proj."))                      # [heads, v, rank]
        out[k_name.replace(".k_b_proj.", ".kv_b_proj.")] = np.concatenate([k, v], 1).reshape(-1, k.shape[2])
    if arch == "qwen3next":  # HF's in_proj_qkvz: per key head its q, its k, its value heads' v, their z
        heads = cfg["linear_num_key_heads"]
        for qkv_name in [n for n in out if n.endswith(".in_proj_qkv.weight")]:
            qkv, z = out.pop(qkv_name), out.pop(qkv_name.replace("_qkv.", "_z."))
            key = heads * cfg["linear_key_head_dim"]
            parts = (*np.split(qkv, [key, 2 * key]), z)
            out[qkv_name.replace("_qkv.", "_qkvz.")] = np.concatenate(
                [p.reshape(heads, -1, qkv.shape[1]) for p in parts], 1).reshape(-1, qkv.shape[1])
    if cfg["architectures"][0] == "BambaForCausalLM":
        _bamba_names(out)
    elif arch in ("granitemoe", "granitehybrid"):
        _granite_names(out, cfg)
    elif arch == "gemma4":
        _gemma4_names(out, cfg)
    return out


def _gemma4_names(out: dict, cfg: dict) -> None:
    """Gemma 4's experts stacked, as its HF checkpoints hold them (gate_up_proj, down_proj)."""
    for i in range(cfg["num_hidden_layers"] if cfg.get("enable_moe_block") else 0):
        p = f"model.layers.{i}.experts."
        out[p + "gate_up_proj"], out[p + "down_proj"] = _stacked_experts(out, p, cfg["num_experts"])


def _stacked_experts(out: dict, prefix: str, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The experts under prefix (prefix + "E.gate_proj.weight" and so on), taken out of out and stacked as HF's
    checkpoints hold them: gate and up [E, 2 * width, hidden] (an expert's gate rows, then its up rows), down
    [E, hidden, width]."""
    gate_up = np.stack([np.concatenate([out.pop(f"{prefix}{e}.{proj}.weight") for proj in ("gate_proj", "up_proj")])
                        for e in range(experts)])
    return gate_up, np.stack([out.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)])


def _bamba_names(out: dict) -> None:
    """Bamba's tensors under the names of its HF checkpoints: feed_forward its MLP, pre_ff_layernorm the MLP's norm,
    final_layernorm the last norm."""
    for name in list(out):
        out[name.replace(".mlp.", ".feed_forward.").replace(".post_attention_layernorm.", ".pre_ff_layernorm.")
            .replace("model.norm.", "model.final_layernorm.")] = out.pop(name)


def _granite_names(out: dict, cfg: dict) -> None:
    """Granite MoE's and Granite 4.0-H's tensors under the names of their HF checkpoints: each layer's experts
    stacked (input_linear [E, 2 * width, hidden]: an expert's gate rows, then its up rows), the router's, the shared
    MLP's gate and up in one (a dense Granite 4.0-H's MLP is its shared MLP)."""
    experts = cfg.get("num_local_experts") or 0
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if experts:
            out[p + "block_sparse_moe.router.layer.weight"] = out.pop(p + "mlp.gate.weight")
            out[p + "block_sparse_moe.input_linear.weight"], out[p + "block_sparse_moe.output_linear.weight"] = \
                _stacked_experts(out, p + "mlp.experts.", experts)
        mlp = p + ("mlp.shared_expert." if experts else "mlp.")
        if mlp + "gate_proj.weight" in out and cfg["architectures"][0] != "GraniteMoeForCausalLM":
            out[p + "shared_mlp.input_linear.weight"] = np.concatenate(
                [out.pop(mlp + "gate_proj.weight"), out.pop(mlp + "up_proj.weight")])
            out[p + "shared_mlp.output_linear.weight"] = out.pop(mlp + "down_proj.weight")


def _unpermute_heads(cfg: dict, permuted: bool) -> dict:
    return {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} if permuted else {}


def convert_gguf(gguf_path: str, out_dir: str, weights: bool = True) -> None:
    """An HF folder from the GGUF file: config, tokenizer and, with weights, the tensors dequantized to fp32
    safetensors (for transformers, and to compare the compact path with). Without weights the folder names the
    GGUF file, and each stage reads its tensors from it."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = os.path.abspath(gguf_path)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists")
    reader = _open(path)
    arch, (_, model_type, permuted), cfg = _hf_config(reader, path)
    if weights and arch in ("gptneox", "phi2") and any(t.name.endswith(".attn_qkv.weight") for t in reader.tensors):
        how = "interleaves them by head" if arch == "gptneox" else "keeps them apart"
        raise ValueError(f"{path}: a {arch} file's q, k and v in one tensor (attn_qkv) have no name in HF's "
                         f"{model_type} checkpoints (HF's {how}); run the file itself, without an HF copy (no "
                         "--compare-hf)")
    if weights:
        tensors = _tensors(reader, path, arch, cfg, permuted)
    else:
        table = _tensor_table(reader, path, arch, cfg, permuted)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # build next to out_dir and rename at the end, so a crash never leaves a half-written folder
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        if weights:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            del tensors
        else:
            with open(os.path.join(tmp, TABLE_FILE), "w") as f:
                json.dump(table, f)
            _write_source(tmp, path)
        if weights:  # their value heads as HF groups them
            cfg = {k: v for k, v in cfg.items() if k != "linear_heads_tiled"}
        AutoConfig.for_model(model_type, **cfg).save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"]).save_pretrained(tmp)
        try:
            with _tokenizer_reads(arch):
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


@contextlib.contextmanager
def _tokenizer_reads(arch: str):
    """transformers builds a GGUF file's tokenizer only for the architectures whose weights it also maps, though the
    tokenizer (tokenizer.ggml.*) does not depend on them: for that call, it counts this one among them. For gpt-oss
    its reader also hides the rope scaling keys, which transformers' config parsing reads wrongly (it takes a key's
    length field for the value: float() of an array), for gemma4 the KV heads of each layer, which its config
    refuses as a list; the tokenizer needs none of them. A command-r, ernie4_5-moe,
    hunyuan-dense, deepseek2, glm4moe, minimax-m2, qwen3next, granitehybrid, nemotron_h_moe, falcon-h1, lfm2moe,
    gptneox, phi2 or exaone-moe file is shown as the model type transformers knows."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as known

    shown = {"command-r": "cohere", "ernie4_5-moe": "ernie4_5_moe", "hunyuan-dense": "hunyuan_v1_dense",
             "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2",
             "qwen3next": "qwen3_next", "granitehybrid": "granitemoehybrid",
             "nemotron_h_moe": "nemotron_h", "falcon-h1": "falcon_h1", "lfm2moe": "lfm2_moe", "gptneox": "gpt_neox",
             "phi2": "phi", "exaone-moe": "exaone_moe"}.get(arch, arch)
    added = shown not in known.GGUF_SUPPORTED_ARCHITECTURES
    if added:
        known.GGUF_SUPPORTED_ARCHITECTURES.append(shown)
    reader = gguf.GGUFReader
    hidden = tuple(f"{arch}.{key}" for key in {"gpt-oss": ["rope.scaling."],
                                               "gemma4": ["attention.head_count_kv"]}.get(arch, []))

    class ReaderForTokenizer(reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if hidden and k.startswith(hidden)]:
                del self.fields[key]
            if shown != arch:
                field = self.fields["general.architecture"]
                field.parts[field.data[0]] = np.frombuffer(shown.encode(), dtype=np.uint8)

    if hidden or shown != arch:
        gguf.GGUFReader = ReaderForTokenizer  # transformers imports it from gguf as it reads
    try:
        yield
    finally:
        gguf.GGUFReader = reader
        if added:
            known.GGUF_SUPPORTED_ARCHITECTURES.remove(shown)


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
        _write_source(folder, os.path.abspath(gguf_path))  # the same content may have moved
        return folder
    logger.info("reading the metadata of %s into %s (once; later starts reuse it)", gguf_path, folder)
    try:
        convert_gguf(gguf_path, folder, weights=False)
    except OSError:  # another process may have finished the same conversion first
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
    return folder


def _write_source(folder: str, gguf_path: str) -> None:
    tmp = os.path.join(folder, f".{SOURCE_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"file": gguf_path}, f)
    os.replace(tmp, os.path.join(folder, SOURCE_FILE))


def gguf_source(folder: str) -> str | None:
    """The GGUF file whose tensors a cached folder stands for, or None for an ordinary safetensors folder."""
    pointer = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = json.load(f)["file"]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} reads its weights from {path}, which no longer exists; "
                                "pass the .gguf file again")
    return path


def _tensor_table(reader, path: str, arch: str, cfg: dict, permuted: bool) -> list[dict]:
    """Where each tensor lies in the file, so that stages find theirs without parsing the metadata again (the
    reader spends seconds on a large vocabulary). A stacked expert tensor gives one entry per expert."""
    heads = _unpermute_heads(cfg, permuted)
    table = []
    for t, name, shape, expert in _entries(reader, path, arch, cfg):
        # a part's bytes: its rows' share of the tensor's (whole rows of blocks)
        size = int(t.n_bytes) if expert is None else \
            int(t.n_bytes) * math.prod(shape[:-1]) // math.prod(int(d) for d in t.shape[1:])
        table.append({"name": t.name, "hf_name": name, "type": int(t.tensor_type), "shape": list(shape),
                      "offset": int(t.data_offset) + (expert or 0) * size, "nbytes": size,
                      "unpermute_heads": heads.get(t.name.split(".")[-2]),
                      "stored_as": stored_as(arch, t.name)})
    return table


def load_gguf_stage_weights(model: nn.Module, folder: str, dtype: torch.dtype) -> list[str]:
    """Fills a stage model built on the meta device with the tensors it owns, read from the folder's GGUF file:
    linear and embedding weights stay compact (CompactLinear / CompactEmbedding), the rest (norms, biases) become
    dtype. Other stages' tensors are never read. Returns the names read."""
    from gguf import GGMLQuantizationType

    from pipellm.quant.gguf_blocks import mapped_embedding, repack
    from pipellm.quant.linear import F32, CompactEmbedding, CompactLinear, MappedEmbedding

    path = gguf_source(folder)
    with open(os.path.join(folder, TABLE_FILE)) as f:
        table = json.load(f)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    pieces: dict[str, list] = {}  # parameter -> [(first row, a QuantWeight, tensor or MappedEmbedding)]
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    row_order = getattr(model, "row_order", lambda name: None)  # GLM-4's q/k rows: the stage's order, not HF's
    to_layout = getattr(model, "to_param_layout", lambda name, t: t)
    read = []
    for t in table:
        targets = model.map_weight(t["hf_name"])
        if not targets:
            continue
        raw, qtype, shape = data[t["offset"]:t["offset"] + t["nbytes"]], GGMLQuantizationType(t["type"]), t["shape"]
        if len(raw) != t["nbytes"]:
            raise ValueError(f"{path}: tensor {t['name']} runs past the end of the file (truncated?)")
        if len(targets) == 1 and targets[0][0] in embeddings and len(shape) == 2:
            # only looked up here (no tied LM head on this stage): left in the file
            value = mapped_embedding(path, t["offset"], t["nbytes"], qtype, *shape, dtype,
                                     name=f"{path}: {t['name']}")
        elif len(shape) != 2 or t["stored_as"]:  # a vector (norm, bias), DeepSeek's heads' k_b and v_b [heads,
            # rows, columns], or values the converter changed (Jamba's A [width, state])
            from gguf.quants import dequantize
            value = undo(t["stored_as"], np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape))
            value = to_layout(t["hf_name"], torch.tensor(value)).to(model.get_parameter(targets[0][0]).dtype)
        else:
            value = repack(raw, qtype, *shape, name=f"{path}: {t['name']}")
            if t["unpermute_heads"]:  # llama.cpp's rotary row order, undone by moving whole rows
                order = unpermute_qk(np.arange(shape[0])[:, None], t["unpermute_heads"])[:, 0]
                value = value.take_rows(torch.from_numpy(order))
        if (order := row_order(t["hf_name"])) is not None:
            value = value[order] if isinstance(value, torch.Tensor) else value.take_rows(order)
        read.append(t["hf_name"])
        for param, row, *index in targets:  # index: one head's slice of a [heads, ...] tensor
            pieces.setdefault(param, []).append((row, value[index[0]] if index else value))

    def parts_of(param: str, rows: int) -> list:
        got = sorted(pieces.pop(param, []), key=lambda p: p[0])
        if [r for r, _ in got] != list(itertools.accumulate([0] + [_rows(v) for _, v in got[:-1]])) or \
                sum(_rows(v) for _, v in got) != rows:
            raise ValueError(f"{path}: tensors for {param} are missing")
        return [v for _, v in got]

    for mod_name, module in list(model.named_modules()):
        prefix = mod_name + "." if mod_name else ""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            rows = module.weight.shape[0]
            parts = parts_of(prefix + "weight", rows)
            bias = parts_of(prefix + "bias", rows) if getattr(module, "bias", None) is not None else None
            bias = torch.cat(bias).float() if bias else None
            if isinstance(parts[0], MappedEmbedding):
                replacement = parts[0]
            elif all(p.kind == F32 for p in parts):  # fp32 in the file: an ordinary layer in dtype
                module.weight = nn.Parameter(torch.cat([p.codes for p in parts]).to(dtype), requires_grad=False)
                if bias is not None:
                    module.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
                continue
            elif isinstance(module, nn.Embedding):
                replacement = CompactEmbedding(parts[0], dtype)
            else:
                replacement = CompactLinear(parts, bias)
            parent = model.get_submodule(mod_name.rpartition(".")[0])
            setattr(parent, mod_name.rpartition(".")[2], replacement)
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            module_name, _, attr = name.rpartition(".")
            value = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize().to(param.dtype)
                               for p in parts_of(name, param.shape[0])])  # a weight outside a linear layer
            setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{path}: no tensors for {', '.join(left[:5])}")
    return read


def _rows(value) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else value.num_rows
