"""Decode steps of a Llama-family stage (Gemma's layers too) in one call to our kernels (kernels/layer.cpp's
DecoderStack): the same kernels and torch ops as the layers' forward, in the same order, without the ~15 Python calls
a layer that cost more than the step's matmuls on small models (BENCHMARKS.md). The layers' forward stays the
reference, and the path of every step that is not all decodes, and of every layer this file does not know."""
import torch
import torch.nn.functional as F
from torch import nn

from pipellm import kernels
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm, TransposedLinear
from pipellm.quant.linear import CompactLinear, kernels_take


def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step can take the fused path: fp32 rows on the CPU (or bf16 rows where compact weights take them
    as they are), each the one new token of its sequence, in order, for the full and the sliding layers alike, with
    nothing recorded per layer."""
    return kernels_take(x.dtype) and x.is_cpu and all(
        m.decode is not None and m.decode.token_idx is None and not m.prefills and m.probe is None
        for m in (meta, meta.local or meta))


def step_args(meta: AttentionMetadata, rope: tuple, rope_local: tuple) -> tuple[tuple, tuple]:
    """DecoderStack.decode's arguments for the full and the sliding layers (their own rotary tables, and with rings
    of blocks their own slots and tables)."""
    local = meta.local or meta
    return tuple((*r, m.slot_mapping, m.decode.block_tables, m.decode.seq_lens, m.decode.window)
                 for m, r in ((meta, rope), (local, rope_local)))


def _norm(module: nn.Module, eps: float) -> torch.Tensor | None:
    """The weight the kernels' rms_norm takes for this norm (Gemma's: 1 + w, as its forward passes), or None for a
    norm it cannot run. bf16 norms are Llama's only: Gemma's forward keeps bf16 rows off the kernel."""
    dtypes = (torch.float32, torch.bfloat16) if type(module) is RMSNorm else (torch.float32,)
    if type(module) not in (RMSNorm, GemmaRMSNorm) or module.weight.dtype not in dtypes or module.eps != eps:
        return None
    return 1.0 + module.weight.detach() if type(module) is GemmaRMSNorm else module.weight.detach()


def build_stack(layers: nn.ModuleList, kv_caches: list[KVCache]):
    """The kernels' DecoderStack over these layers and their caches, or None where a layer has parts it lacks
    (other norms or activations, other layers) or the kernels are not built."""
    from pipellm.models.gemma import GemmaLayer  # gemma.py and llama.py import this file
    from pipellm.models.llama import LlamaLayer
    from pipellm.models.moe import SparseMoE

    ops = kernels.load()
    if ops is None:
        return None
    fused = []
    for layer, cache in zip(layers, kv_caches):
        if type(layer) not in (LlamaLayer, GemmaLayer):
            return None
        attn, eps = layer.self_attn, layer.input_layernorm.eps
        if attn.sinks is not None or attn.norm_after_rope or attn.l2_qk_norm or attn.gate_size or \
                hasattr(attn, "q_norm") and attn.q_norm.weight.numel() != attn.head_dim:
            return None  # the kernels' attention takes no sinks, and norms each head of q and k before their rotary
        if type(layer.mlp) is SparseMoE:
            moe = layer.mlp
            if hasattr(moe, "shared_expert") or moe.selection_bias is not None or moe.softmax_after_topk \
                    or moe.sigmoid or moe.groups > 1 or moe.scaling != 1 or moe.sparsemixer_eps:
                return None  # the kernels' Experts: a softmax's top k, weighed unscaled, and no shared expert
            experts = [_mlp(ops, e) for e in moe.experts]
            router = _linear(ops, moe.gate)
            mlp = None if None in experts or router is None else ops.Experts(router, experts, moe.top_k,
                                                                             moe.norm_topk_prob)
        else:
            mlp = _mlp(ops, layer.mlp)
        gemma = type(layer) is GemmaLayer
        names = (["input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                  "post_feedforward_layernorm"] if gemma else ["input_layernorm", "post_attention_layernorm"])
        norms = [_norm(getattr(layer, n), eps) for n in names]
        head_norms = [_norm(getattr(attn, n), eps) for n in ("q_norm", "k_norm") if hasattr(attn, "q_norm")]
        linears = [_linear(ops, m) for m in (attn.qkv_proj, attn.o_proj)]
        if None in norms + head_norms + linears or mlp is None or len({n.dtype for n in norms + head_norms}) > 1:
            return None
        if norms[0].dtype == torch.bfloat16 and (type(layer.mlp) is SparseMoE or not kernels_take(torch.bfloat16)):
            return None  # bf16: the layers' own experts, and their fp32 rows where the kernels take none in bf16
        q_norm, k_norm = head_norms or (None, None)
        attn_out_norm, mlp_out_norm = norms[2:] or (None, None)
        fused.append(ops.DecoderLayer(norms[0], norms[1], *linears, mlp, eps, attn.scale, attn.num_heads,
                                      attn.num_kv_heads, attn.head_dim, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                      q_norm, k_norm, attn_out_norm, mlp_out_norm, attn.is_sliding,
                                      attn.softcap or 0.0, attn.rotary, getattr(layer, "residual_multiplier", 1.0)))
    stack = ops.DecoderStack(fused)
    for i, layer in enumerate(layers):  # LoRA adapters (pipellm/lora.py): the stack adds those of these four
        modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj}
        if type(layer.mlp) is GatedMLP:
            modules |= {"gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
        for name, module in modules.items():
            if getattr(module, "slots", None):
                stack.set_lora(i, name, module.slots)
        if any(getattr(m, "slots", None) for m in layer.modules() if all(m is not x for x in modules.values())):
            return None  # an adapter of another linear layer (a router's): the layers' forward adds it
    return stack


def lora_rows(layers: nn.ModuleList) -> list:
    """DecoderStack.decode's lora_rows: the rows of each LoRA slot in use this step (StepRows, which the stage
    sets and every LoRALinear of its layers shares); [] without adapters."""
    rows = getattr(layers[0].self_attn.qkv_proj, "rows", None) if len(layers) else None
    return rows.groups if rows is not None else []


def _mlp(ops, mlp: nn.Module):
    """The kernels' GatedMlp for a GatedMLP (SwiGLU, or else GeGLU: the two it makes), or None."""
    if type(mlp) is not GatedMLP:
        return None
    gate_up, down = _linear(ops, mlp.gate_up_proj), _linear(ops, mlp.down_proj)
    return None if gate_up is None or down is None else ops.GatedMlp(gate_up, down, mlp.act is not F.silu)


def _linear(ops, module: nn.Module):
    """The kernels' Linear for a stage's linear module, or None for one it cannot run."""
    module = getattr(module, "base", module)  # a LoRALinear's (its adapters: build_stack's set_lora)
    bias = getattr(module, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        return None
    if isinstance(module, CompactLinear):  # the blocks' products, then the bias
        return ops.Linear.concat([p.matmul_fn() for p in module.parts], bias)
    if isinstance(module, TransposedLinear) and module.weight_t.dtype == torch.float32:
        return ops.Linear.dense(module.weight_t, bias)  # our kernel for few rows, else one addmm
    return None
