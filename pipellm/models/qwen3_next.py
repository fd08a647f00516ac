"""Qwen3-Next and Qwen3.5 (dense and MoE): three linear-attention layers (linear_attention.py) to each full-attention
one, whose output is gated by a sigmoid of a second q_proj; Gemma's 1 + w RMSNorms, q/k norms, partial rotary, and
in the MoE models a sigmoid-gated shared expert beside the routed ones (Qwen2-MoE's)."""
import torch

from pipellm.models.layers import GemmaRMSNorm
from pipellm.models.linear_attention import GatedDeltaNet
from pipellm.models.llama import LAYER_NAME, LlamaStage, StateLayer, gated_q_rows


class Qwen3NextLayer(StateLayer):
    mixer_name, mixer_class = "linear_attn", GatedDeltaNet


class Qwen3NextStage(LlamaStage):
    layer_class, norm_class = Qwen3NextLayer, GemmaRMSNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        """q_proj's rows, reordered (row_order), hold q then the output gate: k and v go after both. The linear
        layers' projections fill one in_proj: q, k, v, z, b, a."""
        m = LAYER_NAME.match(name)
        if not m or not self.stage.start <= int(m[1]) < self.stage.end:
            return super().map_weight(name)
        cfg, prefix, (module, _, kind) = self.cfg, f"layers.{int(m[1]) - self.stage.start}.", m[2].rpartition(".")
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hk, hv, dk, dv, _ = cfg.linear_attention
        conv = 2 * hk * dk + hv * dv
        rows = {"self_attn.q_proj": 0, "self_attn.k_proj": 2 * q, "self_attn.v_proj": 2 * q + kv,
                "linear_attn.in_proj_qkv": 0, "linear_attn.in_proj_qkvz": 0, "linear_attn.in_proj_z": conv,
                "linear_attn.in_proj_b": conv + hv * dv, "linear_attn.in_proj_ba": conv + hv * dv,
                "linear_attn.in_proj_a": conv + hv * dv + hv}
        if module in rows:
            target = "self_attn.qkv_proj" if module.startswith("self_attn") else "linear_attn.in_proj"
            return [(f"{prefix}{target}.{kind}", rows[module])]
        return super().map_weight(name)

    def row_order(self, name: str) -> torch.Tensor | None:
        """q_proj's rows as [q of every head, then the gate of every head] (the checkpoint's: per head, q then its
        gate); Qwen3-Next's in_proj_qkvz and in_proj_ba as [q, k, v, z] and [b, a] (the checkpoint's: per key head,
        its q, k and its value heads' v, z; its value heads' b, a)."""
        cfg = self.cfg
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            return gated_q_rows(cfg)
        hk, hv, dk, dv, _ = cfg.linear_attention
        r = hv // hk
        if ".linear_attn.in_proj_qkvz." in name:
            return _grouped(hk, (dk, dk, r * dv, r * dv))
        if ".linear_attn.in_proj_ba." in name:
            return _grouped(hk, (r, r))
        return None


def _grouped(groups: int, widths: tuple[int, ...]) -> torch.Tensor:
    """Rows laid out per group as parts of these widths -> each part of every group, part after part."""
    rows = torch.arange(groups * sum(widths)).view(groups, -1)                         # [groups, sum of widths]
    return torch.cat([part.flatten() for part in rows.split(list(widths), 1)])
