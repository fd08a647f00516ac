"""Rotary positions, every variant HF's rope utilities know: default, linear, dynamic (NTK), llama3, yarn, longrope,
proportional.
The inverse frequencies follow transformers' modeling_rope_utils; cos and sin are computed per step for the step's
positions (no table as long as the context), once for all the layers of a stage."""
import math
from typing import NamedTuple

import torch
from torch import nn

from pipellm import kernels
from pipellm.rope_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_positions: int,
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """[rotated_dim / 2] inverse frequencies and the factor on cos/sin. seq_len: the context dynamic and longrope
    scale for (None: the short, unscaled form)."""
    if rope.rope_type == "proportional":  # Gemma 4's: the whole head's pairs, the first share of them turning at
        # head_dim's frequencies, the rest not at all
        turning = int(rope.partial_rotary_factor * head_dim // 2)
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat((inv_freq, torch.zeros(head_dim // 2 - turning))) / rope.factor, 1.0
    dim = int(head_dim * rope.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base, factor, kind = rope.theta, rope.factor, rope.rope_type
    if kind == "dynamic" and seq_len is not None and seq_len > max_positions:
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope.freq_factors:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, exponents), _yarn_attention_factor(rope)
    if kind == "longrope":
        attention = rope.attention_factor
        if attention is None:
            original = rope.original_max_position_embeddings
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), attention
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len, factor = rope.original_max_position_embeddings, rope.factor
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long waves: divided by factor
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled                  # between: interpolated
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def _yarn(rope: RopeConfig, dim: int, exponents: torch.Tensor) -> torch.Tensor:
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** exponents
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """cos and sin for a step's tokens. dynamic and longrope scale by the length of each token's sequence at this
    step, as HF does for the sequence it runs (a whole prompt at once, then one token at a time)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        # on the CPU even when the stage is built on the meta device: computed, not loaded
        with torch.device("cpu"):
            inv_freq, self.attention_factor = inverse_frequencies(rope, head_dim, max_positions)
        self.inv_freq = inv_freq  # not a buffer: stays fp32 when the model is cast to bf16
        self.rotated_dim = 2 * len(inv_freq)
        # the length beyond which a sequence's frequencies change
        self.scaled_from = {"dynamic": max_positions,
                            "longrope": rope.original_max_position_embeddings}.get(rope.rope_type)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               seq_ends: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each token's position, [T, 1, rotated_dim]. seq_ends [T]: each token's sequence length
        after this step (needed by dynamic and longrope only)."""
        if self.inv_freq.device != positions.device:  # moved once: a CUDA graph's capture cannot copy from the host
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]                          # [T, rotated_dim / 2]
        if self.scaled_from is not None and seq_ends is not None and bool((seq_ends > self.scaled_from).any()):
            for end in seq_ends[seq_ends > self.scaled_from].unique().tolist():
                rows = seq_ends == end
                inv_freq, _ = inverse_frequencies(self.rope, self.head_dim, self.max_positions, end)
                freqs[rows] = positions[rows].float()[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)                                       # [T, rotated_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class StepRopes(NamedTuple):
    """What a step's positions give every layer: the rotary tables of the full and of the local layers, and the
    scales [T, 1, 1] of the queries of the layers with rotary and of those without (None: 1 for every token)."""
    full: tuple[torch.Tensor, torch.Tensor]   # cos, sin [T, 1, rotated dims]
    local: tuple[torch.Tensor, torch.Tensor]
    query_scale: torch.Tensor | None = None
    nope_query_scale: torch.Tensor | None = None


def query_scale(beta: float, span: float, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Llama 4's temperature on q, [T, 1, 1]: 1 + beta * log(1 + floor(position / span)) (Ministral 3's and Mistral
    4's on every layer, span their trained context; Llama 4's on its layers without rotary, from position + 1);
    None where it is 1 for every token."""
    if not beta:
        return None
    spans = torch.floor(positions.float() / span)                                        # [T]
    if not bool((spans > 0).any()):
        return None
    return (1 + beta * torch.log(1 + spans)).to(dtype)[:, None, None]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, KV, D] rotated by their positions (HF's rotate_half layout); may rotate them in place.
    With a partial rotary (cos narrower than D), only the first dims turn."""
    ops = kernels.for_tensor(q) if q.dtype == cos.dtype in (torch.float32, torch.bfloat16) else None
    rotated = cos.shape[-1]
    if ops is not None:  # in place, on strided views too (the kernel needs only each head's dims contiguous)
        ops.rotary_(q[..., :rotated], k[..., :rotated], cos, sin)
        return q, k
    if rotated != q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rotated], k[..., :rotated], cos, sin)
        return torch.cat((q_rot, q[..., rotated:]), -1), torch.cat((k_rot, k[..., rotated:]), -1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
