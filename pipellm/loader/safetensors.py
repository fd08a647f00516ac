"""Reads from a safetensors checkpoint only the tensors one stage owns, tensor by tensor."""
import json
import os
from collections.abc import Callable

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from pipellm.quant import fp8, mxfp4
from pipellm.quant.linear import CompactLinear, MappedEmbedding, QuantWeight
from pipellm.vision_language import text_model_names

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers that some checkpoints carry and that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def checkpoint_files(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise ValueError(f"{single}: not a readable safetensors file ({e})") from None
    pickles = sorted(f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(f"{folder}: only pickle checkpoints found ({', '.join(pickles)}); pickle files can run "
                         "arbitrary code and are refused. Convert them to safetensors first.")
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")


# safetensors dtypes a table can be read in place as (numpy has no bfloat16: its bits are read as int16)
MAPPABLE = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16)}


def _mapped_embedding(file: str, name: str, shape: list[int], dtype: torch.dtype) -> MappedEmbedding | None:
    """The embedding table `name` left in its safetensors file (None for a dtype it cannot be read in place as)."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_len))[name]
    if info["dtype"] not in MAPPABLE:
        return None
    if info["shape"] != shape:
        raise ValueError(f"{file}: tensor {name} has shape {info['shape']}, expected {shape} from config.json")
    (np_type, torch_type), (rows, cols) = MAPPABLE[info["dtype"]], shape
    begin, end = info["data_offsets"]
    if end - begin != rows * cols * torch_type.itemsize:
        raise ValueError(f"{file}: tensor {name} has {end - begin} bytes, not those of shape {shape}")

    def expand(raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(raw.view(np_type)).view(torch_type)

    return MappedEmbedding(file, 8 + header_len + begin, rows, cols * torch_type.itemsize, expand, info["dtype"],
                           dtype)


def load_stage_weights(model: nn.Module, folder: str, dtype: torch.dtype,
                       on_filled: Callable[[str], None] | None = None, map_embeddings: bool = True) -> list[str]:
    """Fills model's parameters (best built on the meta device) from the checkpoint; returns the checkpoint names it
    read. Parameters are allocated in dtype and each checkpoint tensor is cast into its place, one at a time: no copy
    of a bf16 checkpoint in fp32 exists. on_filled(parameter name) runs as each parameter becomes whole (quantization
    replaces a linear layer's weights then, so that a stage never holds all of them dense). With map_embeddings, an
    embedding that is only looked up on this stage (no tied LM head beside it) stays in the file (MappedEmbedding)."""
    embeddings = {f"{n}.weight": n for n, m in model.named_modules() if isinstance(m, nn.Embedding)} \
        if map_embeddings else {}
    by_file: dict[str, list[tuple[str, list]]] = {}
    read = []
    files = checkpoint_files(folder)
    stored = text_model_names(files) if model.cfg.text_of else {name: name for name in files}  # own -> file's name
    files = {name: files[file_name] for name, file_name in stored.items()}
    for name, file in files.items():
        if name.endswith(IGNORED_SUFFIXES) or mxfp4.is_scales(name, files) or fp8.is_scales(name, files):
            continue  # scales: read with their blocks or weights
        targets = model.map_weight(mxfp4.packed_name(name, files) or name)
        if len(targets) == 1 and targets[0][1] == 0 and targets[0][0] in embeddings:
            module = embeddings[targets[0][0]]
            mapped = _mapped_embedding(file, stored[name], list(model.get_submodule(module).weight.shape), dtype)
            if mapped is not None:
                parent, _, attr = module.rpartition(".")
                setattr(model.get_submodule(parent), attr, mapped)
                read.append(name)
                continue
        if targets:
            by_file.setdefault(file, []).append((name, targets))
    model.to(dtype).to_empty(device="cpu")  # pages are resident once written: parameter by parameter
    params = dict(model.named_parameters())  # those not yet whole: a whole one is dropped here, so it can be freed
    rows = {name: p.shape[0] for name, p in params.items()}
    filled: dict[str, int] = {}  # parameter -> rows filled
    to_layout = getattr(model, "to_param_layout", lambda name, t: t)
    row_order = getattr(model, "row_order", lambda name: None)  # GLM's, DeepSeek's q/k rows: the stage's order
    compact: dict[str, QuantWeight] = {}  # MXFP4 weights kept compact: parameter -> its weight
    with torch.no_grad():
        for file, entries in by_file.items():
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
            with handle as f:
                for name, targets in entries:
                    try:
                        tensor, parts = f.get_tensor(stored[name]), None
                        if (scales_name := fp8.scales_name(name, files)) is not None:
                            with safe_open(files[scales_name], framework="pt") as g:
                                scales = g.get_tensor(stored[scales_name])
                            tensor = fp8.dequantize(tensor, scales, model.cfg.fp8_block, dtype)
                            read.append(scales_name)
                        elif tensor.dtype == torch.float8_e4m3fn:
                            raise ValueError(f"an FP8 tensor without its {name}{fp8.SCALES}")
                        tensor = to_layout(name, tensor)
                        if (order := row_order(name)) is not None:
                            tensor = tensor[order]
                        dense_name = mxfp4.packed_name(name, files)
                        if dense_name is not None:  # MXFP4 blocks with their scales ([.., out, G, 16], [.., out, G]:
                            scales_name = dense_name + mxfp4.SCALES  # a linear's rows), kept compact or made dense
                            with safe_open(files[scales_name], framework="pt") as g:
                                scales = to_layout(scales_name, g.get_tensor(stored[scales_name]))
                            read.append(scales_name)
                            parts = _compact_parts(tensor, scales, targets, params)
                            if parts is None:
                                tensor = mxfp4.dequantize(tensor, scales, dtype)
                    except Exception as e:
                        raise ValueError(f"{file}: cannot read tensor {name} ({e})") from None
                    read.append(name)
                    for (param_name, *_), part in zip(targets, parts or []):
                        compact[param_name], filled[param_name] = part, rows[param_name]
                        del params[param_name]
                    if parts is not None:
                        continue
                    for param_name, row, *index in targets:  # index: one slice of a stacked tensor
                        param = params.get(param_name)
                        if param is None:
                            raise ValueError(f"{file}: unexpected tensor {name} for this architecture")
                        stacks = not index or tensor.shape[:1] == (len(targets),)
                        src = tensor[index[0]] if index and stacks else tensor
                        dst = param[row:row + src.shape[0]]
                        if not stacks or dst.shape != src.shape:
                            expected = [len(targets), *param.shape] if index else list(dst.shape)
                            raise ValueError(f"{file}: tensor {name} has shape {list(tensor.shape)}, "
                                             f"expected {expected} from config.json")
                        dst.copy_(src)
                        filled[param_name] = filled.get(param_name, 0) + src.shape[0]
                        if filled[param_name] == rows[param_name]:
                            del params[param_name], param, dst
                            if on_filled is not None:
                                on_filled(param_name)
    missing = [n for n, r in rows.items() if filled.get(n, 0) != r]
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks tensors for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    for param_name, part in compact.items():  # their linears become compact ones, with the biases loaded beside
        path = param_name.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        bias = model.get_submodule(path).bias
        bias = None if bias is None else bias.detach().float()
        setattr(model.get_submodule(parent), attr, CompactLinear([part], bias))
    return read


def _compact_parts(blocks: torch.Tensor, scales: torch.Tensor, targets: list, params: dict) -> list | None:
    """Per target, its slice of an MXFP4 pair as a compact weight; None where a target is not a whole linear weight
    of its slice's shape, or a scale has no fp16 form: the pair is then made dense."""
    parts = []
    for param_name, row, *index in targets:
        stacked = bool(index) and blocks.dim() == 4 and len(blocks) == len(targets)
        b, s = (blocks[index[0]], scales[index[0]]) if stacked else (blocks, scales)
        param = params.get(param_name)
        if param is None or row or not param_name.endswith(".weight") or bool(index) != stacked or b.dim() != 3 \
                or list(param.shape) != [b.shape[0], b.shape[1] * 32]:
            return None
        part = mxfp4.quant_weight(b, s)
        if part is None:
            return None
        parts.append(part)
    return parts
