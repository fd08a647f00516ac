from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-step view of the batch for attention, built once per step and shared by every layer of a stage.

    T = tokens in the step, B = sequences, Q = longest query (new tokens of one sequence), K = longest context.
    """
    slot_mapping: torch.Tensor   # [T] flat cache slot each new token's K/V is written to
    block_ids: torch.Tensor      # [B * N] the blocks of each sequence, N per sequence (padding: block 0)
    mask: torch.Tensor | None    # [B, 1, Q, K] True where a query may attend (K = N * block_size);
                                 # None when every row sees all K keys
    token_seq: torch.Tensor      # [T] sequence each token belongs to
    token_off: torch.Tensor      # [T] offset of each token among its sequence's new tokens
    num_seqs: int
    max_query_len: int

    @classmethod
    def build(cls, positions: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              sliding_window: int | None = None) -> "AttentionMetadata":
        # All vector ops: the cost is per step, not per token or per layer.
        num_seqs = len(query_lens)
        max_q = int(query_lens.max())
        # Keys are gathered whole blocks at a time (a row copy each), so K is a multiple of block_size.
        num_blocks = -(-int(seq_lens.max()) // block_size)
        block_ids = block_tables[:, :num_blocks].reshape(-1).long()                     # [B * N]
        key_pos = torch.arange(num_blocks * block_size)
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        token_off = torch.arange(len(positions)) - starts[token_seq]
        # Query positions, padded rows clamped to the last real one so no row is fully masked.
        q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q)[None, :]         # [B, Q]
        q_pos = torch.minimum(q_pos, (seq_lens - 1)[:, None])
        mask = key_pos[None, None, :] <= q_pos[:, :, None]                               # [B, Q, K]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        if max_q == 1 and sliding_window is None and bool((seq_lens == len(key_pos)).all()):
            mask = None  # decode of equal-length sequences: nothing to hide
        else:
            mask = mask[:, None]                                                        # [B, 1, Q, K]
        return cls(slot_mapping, block_ids, mask, token_seq, token_off, num_seqs, max_q)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; caches [num_blocks, block_size, KV, D]. Returns [T, H, D]."""
    num_kv, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv, head_dim)[meta.slot_mapping] = k  # [num_blocks * block_size, KV, D]
    v_cache.view(-1, num_kv, head_dim)[meta.slot_mapping] = v
    num_seqs = meta.num_seqs
    # [B * N, block_size, KV, D] -> [B, N * block_size, KV, D] -> [B, KV, K, D]
    keys = k_cache.index_select(0, meta.block_ids).view(num_seqs, -1, num_kv, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, meta.block_ids).view(num_seqs, -1, num_kv, head_dim).transpose(1, 2)
    if meta.max_query_len == 1:
        queries = q.view(num_seqs, 1, q.shape[1], head_dim)    # [B, 1, H, D]: one new token per sequence
    else:
        queries = q.new_zeros(num_seqs, meta.max_query_len, q.shape[1], head_dim)
        queries[meta.token_seq, meta.token_off] = q            # [B, Q, H, D]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=meta.mask,
                                         scale=scale, enable_gqa=num_kv != q.shape[1])  # [B, H, Q, D]
    out = out.transpose(1, 2)                                  # [B, Q, H, D]
    if meta.max_query_len == 1:
        return out.reshape(-1, q.shape[1], head_dim)
    return out[meta.token_seq, meta.token_off]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF Llama: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]     # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                       # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, KV, D] rotated by their positions (HF's rotate_half layout)."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]      # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TransposedLinear(nn.Module):
    """y = x @ W^T + b with W stored transposed, [in, out] contiguous. On the few-row inputs of decoding,
    MKL runs this layout up to 2x faster than nn.Linear's [out, in] (measured: 16 x 576 x 3072, 1 thread)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def transpose_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear below module (after its weights are loaded) by a TransposedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child))
        else:
            transpose_linears(child)
