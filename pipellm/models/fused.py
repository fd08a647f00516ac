"""Decode steps of a Llama-family stage in one call to our kernels (kernels/layer.cpp's DecoderStack): the same
kernels and torch ops as the layers' forward, in the same order, without the ~15 Python calls a layer that cost
more than the step's matmuls on small models (BENCHMARKS.md). The layers' forward stays the reference, and the path
of every step that is not all decodes, and of every layer this file does not know."""
import torch
import torch.nn.functional as F
from torch import nn

from pipellm import kernels
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import GatedMLP, RMSNorm, TransposedLinear
from pipellm.quant.linear import CompactLinear


def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step can take the fused path: fp32 rows on the CPU, each the one new token of its sequence, in
    order, with full attention and nothing recorded per layer."""
    d = meta.decode
    return (x.dtype == torch.float32 and x.is_cpu and d is not None and d.token_idx is None and not meta.prefills
            and d.window == 0 and meta.local is None and meta.probe is None)


def build_stack(layers: nn.ModuleList, kv_caches: list[KVCache]):
    """The kernels' DecoderStack over these layers and their caches, or None where a layer has parts it lacks
    (qk-norm, soft-capping, sliding windows, experts, GeGLU, other norms) or the kernels are not built."""
    from pipellm.models.llama import LlamaLayer  # llama.py imports this file

    ops = kernels.load()
    if ops is None:
        return None
    fused = []
    for layer, cache in zip(layers, kv_caches):
        if type(layer) is not LlamaLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if (hasattr(attn, "q_norm") or attn.softcap is not None or attn.is_sliding or type(mlp) is not GatedMLP
                or mlp.act is not F.silu or any(type(n) is not RMSNorm or n.weight.dtype != torch.float32
                                                for n in (layer.input_layernorm, layer.post_attention_layernorm))):
            return None
        linears = [_linear(ops, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in linears:
            return None
        fused.append(ops.DecoderLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears,
                                      layer.input_layernorm.eps, attn.scale, attn.num_heads, attn.num_kv_heads,
                                      attn.head_dim, cache.k, cache.v, cache.k_scale, cache.v_scale))
    return ops.DecoderStack(fused)


def _linear(ops, module: nn.Module):
    """The kernels' Linear for a stage's linear module, or None for one it cannot run."""
    bias = getattr(module, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        return None
    if isinstance(module, CompactLinear):  # the blocks' products, then the bias
        return ops.Linear.concat([p.matmul_fn() for p in module.parts], bias)
    if isinstance(module, TransposedLinear) and module.weight_t.dtype == torch.float32:
        return ops.Linear.dense(module.weight_t, bias)  # one addmm
    return None
