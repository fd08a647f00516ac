"""LoRA adapters, as vLLM serves them: a request names a PEFT adapter folder (LoRARequest) and its tokens run through
the base model's weights plus that adapter's low-rank products, beside requests of other adapters or none in the
same batch. Each stage reads only its own layers' tensors of the adapter; the driver checks the whole adapter
against the model before a request of it is queued."""
import itertools
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from pipellm.models.layers import TransposedLinear
from pipellm.quant.linear import CompactLinear

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")  # PEFT's names, the adapter's own name dropped


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: lora_name names the adapter (the server's model name for it), lora_int_id is a number of
    the user's, unique to it, and lora_path is the PEFT folder (adapter_config.json, adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name={self.lora_name!r}: must be a non-empty string")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id={self.lora_int_id!r}: must be an integer >= 1")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not os.path.isdir(self.lora_path):
            raise ValueError(f"LoRARequest lora_path={self.lora_path!r}: not a folder; give the folder PEFT's "
                             f"save_pretrained wrote ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")


@dataclass
class Adapter:
    """What a stage needs of an adapter folder: per targeted module of the checkpoint (its name without .weight),
    the names of its A [rank, in] and B [out, rank] tensors and the scale of their product."""
    path: str
    rank: int                                      # the largest of its modules'
    modules: dict[str, tuple[str, str, float]]     # module -> (A's key, B's key, scale)
    shapes: dict[str, tuple[list[int], list[int]]]  # module -> (A's shape, B's shape)


def read_adapter(path: str) -> Adapter:
    """The adapter's config and tensor names and shapes (no tensor data); ValueError for what pipellm cannot run."""
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read {ADAPTER_CONFIG} ({e}); give a PEFT LoRA adapter's folder") from None
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(weights):
        raise ValueError(f"{path}: no {ADAPTER_WEIGHTS}" + (" (adapter_model.bin is pickle, which pipellm does not "
                         "load: save it again with safe_serialization=True)" if os.path.exists(
                             os.path.join(path, "adapter_model.bin")) else ""))
    unsupported = [(cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} (LORA only)"),
                   (cfg.get("use_dora"), "use_dora (DoRA's magnitudes)"),
                   (cfg.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2's Conv1D weights)"),
                   (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r} (trained biases)"),
                   (cfg.get("modules_to_save"), f"modules_to_save {cfg.get('modules_to_save')} (whole modules)")]
    if why := [w for bad, w in unsupported if bad]:
        raise ValueError(f"{path}: pipellm runs plain LoRA adapters; this one has {', '.join(why)}")
    alpha, patterns = cfg.get("lora_alpha", 8), cfg.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    try:
        with safe_open(weights, framework="pt") as f:
            for key in f.keys():
                m = KEY.match(key)
                if not m:
                    raise ValueError(f"tensor {key} is not a LoRA A or B weight of a linear layer")
                pairs.setdefault(m[1], {})[m[2]] = (key, list(f.get_slice(key).get_shape()))
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    except Exception as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    modules, shapes = {}, {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights}: {module} has lora_{''.join(ab)} without its pair")
        (a_key, a_shape), (b_key, b_shape) = ab["A"], ab["B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise ValueError(f"{weights}: {module}'s A {a_shape} and B {b_shape} are not [rank, in] and [out, rank]")
        rank = a_shape[0]
        # PEFT's alpha_pattern: the first key that ends the module's name
        a = next((v for k, v in patterns.items() if re.match(rf"(.*\.)?{k}$", module)), alpha)
        modules[module] = (a_key, b_key, a / (math.sqrt(rank) if cfg.get("use_rslora") else rank))
        shapes[module] = (a_shape, b_shape)
    if not modules:
        raise ValueError(f"{weights}: holds no LoRA weights")
    return Adapter(path, max(a[0] for a, _ in shapes.values()), modules, shapes)


def takes_lora(path: str) -> bool:
    """Whether a stage's linear module at path may take adapters: a decoder layer's, but an expert's (each runs a
    subset of the step's rows)."""
    return path.startswith("layers.") and ".experts." not in path


def targets(model: nn.Module, adapter: Adapter) -> list[tuple[str, int, str]]:
    """(linear module of model, first output row it adds to, the adapter's module) for each of the adapter's modules
    that this stage's model holds; ValueError for one that maps to no linear layer of its decoder layers that takes
    its shape. The driver runs it on a model of every layer (check), so that no stage meets an adapter it cannot run."""
    out = []
    row_order = getattr(model, "row_order", lambda name: None)
    for module, ((_, fan_in), (fan_out, _)) in adapter.shapes.items():
        found = model.map_weight(module + ".weight")
        if not found:
            continue  # another stage's, or (on the whole model) nothing of the model's: check says which
        path = found[0][0].removesuffix(".weight")
        try:
            linear = model.get_submodule(path) if len(found) == 1 and len(found[0]) == 2 else None
        except AttributeError:
            linear = None
        if not takes_lora(path) or not isinstance(linear, (nn.Linear, LoRALinear)) or \
                row_order(module + ".weight") is not None or isinstance(linear, nn.Linear) and (
                    fan_in != linear.in_features or found[0][1] + fan_out > linear.out_features):
            raise ValueError(f"{adapter.path}: {module} ([{fan_out}, {fan_in}] in the adapter) is not a linear layer "
                             "of this model's decoder layers that pipellm can add it to (an adapter of another "
                             "model, of its embedding or LM head, of experts, which run a subset of the rows, or of "
                             "a layer whose rows pipellm reorders at load: GPT-NeoX's query_key_value, GLM's and "
                             "DeepSeek's q and k?)")
        out.append((path, found[0][1], module))
    return out


def check(whole_model: nn.Module, adapter: Adapter, max_rank: int) -> None:
    """ValueError unless every module of the adapter maps to a linear layer of the model (built on the meta device
    with every layer), within max_lora_rank."""
    if adapter.rank > max_rank:
        raise ValueError(f"{adapter.path}: rank {adapter.rank} is above max_lora_rank={max_rank}; start the engine "
                         f"with max_lora_rank={adapter.rank} or more")
    missing = set(adapter.modules) - {m for _, _, m in targets(whole_model, adapter)}
    if missing:
        raise ValueError(f"{adapter.path}: {', '.join(sorted(missing)[:3])} name(s) no layer of this model")


class Adapters:
    """The driver's adapters (enable_lora): each name's LoRARequest, checked against the model when first named, and
    the salt its requests' cached prefixes start from: one of its own each time an adapter is added, so that one
    removed and added again (its files maybe changed) never meets the K/V of the one before."""

    def __init__(self, model_config, max_rank: int):
        self.model_config, self.max_rank = model_config, max_rank
        self.known: dict[str, tuple[LoRARequest, bytes]] = {}  # name -> (adapter, salt)
        self._added = itertools.count(1)
        self._model = None  # every layer, on the meta device: what each adapter's modules must map to

    def check(self, lora: LoRARequest, replace: bool = False) -> bytes:
        """ValueError unless the model can run lora; adds it when new (replace: in place of another adapter of its
        name, once it is found runnable). Returns its salt."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path), not "
                             f"{type(lora).__name__}")
        known = self.known.get(lora.lora_name)
        if known is not None and known[0] == lora:
            return known[1]
        if known is not None and not replace:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is already {known[0]}; one name names one adapter: "
                             "give this one another name")
        if other := next((k for name, (k, _) in self.known.items()
                          if k.lora_int_id == lora.lora_int_id and name != lora.lora_name), None):
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {other.lora_name!r}'s; give "
                             f"{lora.lora_name!r} another id")
        if self._model is None:
            from pipellm.models.registry import build_stage_model
            from pipellm.pipeline.partition import StageLayers
            layers = StageLayers(0, 0, self.model_config.num_layers, True, True)
            self._model = build_stage_model(self.model_config, layers, meta=True)
        check(self._model, read_adapter(str(lora.lora_path)), self.max_rank)
        salt = f"lora:{next(self._added)}:{lora.lora_name}".encode()
        self.known[lora.lora_name] = (lora, salt)
        return salt

    def remove(self, lora_id: int) -> bytes | None:
        """Forgets the adapter of that id: its salt, or None where no adapter has it."""
        name = next((n for n, (k, _) in self.known.items() if k.lora_int_id == lora_id), None)
        return None if name is None else self.known.pop(name)[1]


# ---- on a stage -------------------------------------------------------------------------------------------------

class StepRows:
    """Which of a step's T rows run which adapter slot, shared by a stage's LoRALinears: (slot, row indices, or
    None for every row) for each slot in use."""

    def __init__(self):
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.num_rows = 0


class LoRALinear(nn.Module):
    """A stage's linear layer with the adapters loaded in its slots beside it: a row of a request of an adapter adds
    (x A) B, where A holds the A^T of each of the adapter's modules that this layer fills (q, k and v: qkv_proj)
    side by side, and B their scale * B^T, each in its own rows and in the output columns its module fills."""

    def __init__(self, base: nn.Module, rows: StepRows, out_features: int):
        super().__init__()
        self.base, self.rows, self.out_features = base, rows, out_features
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (A [in, R], B [R, out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.rows.groups and x.shape[0] != self.rows.num_rows:
            raise ValueError(f"a LoRA layer got {x.shape[0]} rows in a step of {self.rows.num_rows}")
        for slot, idx in self.rows.groups:
            if (ab := self.slots.get(slot)) is not None:
                if idx is None:
                    y.addmm_(x @ ab[0], ab[1])
                else:
                    y.index_add_(0, idx, (x[idx] @ ab[0]) @ ab[1])
        return y


def out_features(linear: nn.Module) -> int:
    return linear.weight_t.shape[1] if isinstance(linear, TransposedLinear) else sum(p.num_rows for p in linear.parts)


class StageAdapters:
    """A stage's LoRA slots: every linear layer of its decoder layers (but experts') wrapped in a LoRALinear, the
    adapters each slot holds, and which rows of a step run which."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.rows, self.modules, self.loaded = StepRows(), {}, {}
        for name, parent in list(model.named_modules()):
            for child_name, child in parent.named_children():
                if isinstance(child, (TransposedLinear, CompactLinear)) and takes_lora(f"{name}.{child_name}"):
                    wrapped = LoRALinear(child, self.rows, out_features(child))
                    setattr(parent, child_name, wrapped)
                    self.modules[f"{name}.{child_name}"] = wrapped

    def load(self, slot: int, path: str) -> None:
        """The adapter at path into slot, replacing what it held: this stage's layers' tensors only."""
        for m in self.modules.values():
            m.slots.pop(slot, None)
        self.loaded.pop(slot, None)
        if hasattr(self.model, "_fused"):
            self.model._fused = None  # the one-call decode step (models/fused.py) is built again with the new one
        adapter = read_adapter(path)
        parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        with safe_open(os.path.join(path, ADAPTER_WEIGHTS), framework="pt") as f:
            for module_path, row, module in targets(self.model, adapter):
                a_key, b_key, scale = adapter.modules[module]
                parts.setdefault(module_path, []).append((row, f.get_tensor(a_key), f.get_tensor(b_key) * scale))
        for module_path, ps in parts.items():
            a = torch.cat([pa for _, pa, _ in ps]).t()                                        # [in, R]
            b = torch.zeros(a.shape[1], self.modules[module_path].out_features)              # [R, out]
            r = 0
            for row, pa, pb in ps:  # each module's rank in its own rows of B, in its own columns
                b[r:r + len(pa), row:row + len(pb)] = pb.t()
                r += len(pa)
            self.modules[module_path].slots[slot] = tuple(t.to(self.device, self.dtype).contiguous() for t in (a, b))
        self.loaded[slot] = path

    def set_step(self, slots: np.ndarray | None, query_lens: np.ndarray) -> None:
        """The step's rows of each slot, from each sequence's slot (-1: the base model alone)."""
        per_row = np.repeat(slots, query_lens) if slots is not None else np.empty(0, np.int64)   # [T]
        used = np.unique(per_row[per_row >= 0]).tolist()
        if missing := [s for s in used if s not in self.loaded]:
            raise ValueError(f"lora_slots name slot(s) {missing} that hold no adapter on this stage")
        self.rows.num_rows = len(per_row)
        self.rows.groups = [(s, None) if len(used) == 1 and (per_row == s).all() else
                            (s, torch.from_numpy(np.flatnonzero(per_row == s)).to(self.device)) for s in used]
