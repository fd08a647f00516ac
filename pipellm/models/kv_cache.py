"""One layer's paged KV cache, in the dtype the user chose (kv_cache_dtype): the activations' own, bfloat16, or int8
with one scale per block and KV head. Fewer bytes per cached token hold more tokens in the same memory and read
faster where long contexts make attention memory-bound."""
from dataclasses import dataclass

import torch

from pipellm import kernels
from pipellm.config import KV_CACHE_DTYPES
from pipellm.models.huge_pages import zeros_on_huge_pages

INT8_MAX = 127.0


def cache_dtype(kv_cache_dtype: str, activations: torch.dtype) -> torch.dtype:
    return activations if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def block_bytes(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int, shared: bool = False) -> int:
    """Bytes of one block of one layer, K and V (once where they are one tensor), with int8's fp32 scales."""
    values = block_size * num_kv_heads * head_dim * dtype.itemsize
    return (1 if shared else 2) * (values + (num_kv_heads * 4 if dtype == torch.int8 else 0))


@dataclass
class KVCache:
    k: torch.Tensor                       # [num_blocks, block_size, KV, D]
    v: torch.Tensor                       # k itself where K and V are one (MLA's latent, models/deepseek.py)
    k_scale: torch.Tensor | None = None   # [num_blocks, KV] fp32, int8 caches only: value = int8 * scale
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", shared: bool = False) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        def scales():
            return torch.zeros(num_blocks, num_kv_heads, device=device) if dtype == torch.int8 else None

        def values():
            if torch.device(device).type == "cpu":
                return zeros_on_huge_pages(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)
        if shared:
            k, k_scale = values(), scales()
            return cls(k, k, k_scale, k_scale)
        return cls(values(), values(), scales(), scales())

    @property
    def shared(self) -> bool:
        return self.v is self.k

    @property
    def nbytes(self) -> int:
        tensors = (self.k, self.k_scale) if self.shared else (self.k, self.v, self.k_scale, self.v_scale)
        return sum(t.nbytes for t in tensors if t is not None)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks src[i] -> dst[i], every slot, scales too. src and dst: [C] int64, no block in both."""
        for t in (self.k, self.k_scale) if self.shared else (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[dst] = t[src]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, KV, D] into flat slots [T] (block * block_size + offset); a shared cache's v is k."""
        ops = kernels.for_tensor(self.k)
        if self.k_scale is None:
            if ops is not None and k.dtype == self.k.dtype and k.stride(-1) == v.stride(-1) == 1:
                ops.kv_cache_write(self.k, self.v, slots, k, v)  # one call instead of two index_puts
                return
            self.k.view(-1, *k.shape[1:])[slots] = k.to(self.k.dtype)  # [num_blocks * block_size, KV, D]
            self.v.view(-1, *v.shape[1:])[slots] = v.to(self.v.dtype)
            return
        write = _write_int8 if ops is None else ops.kv_cache_write_int8
        write(self.k, self.k_scale, slots, k.float().contiguous())
        if not self.shared:
            write(self.v, self.v_scale, slots, v.float().contiguous())

    def keys(self, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
        """K of num_seqs sequences' blocks, [S * N] block ids -> [S, KV, K = N * block_size, D], in dtype."""
        return _gather(self.k, self.k_scale, block_ids, num_seqs, dtype)

    def values(self, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
        """V, as keys()."""
        return _gather(self.v, self.v_scale, block_ids, num_seqs, dtype)


def _write_int8(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, KV, D] fp32. A block's scale is the largest |value| written to it per head / 127. A block's first token
    (offset 0: a new block, or a reused one) starts it afresh; a later token that is larger raises it and rescales
    what the block holds, so earlier tokens keep their error within a step of the new scale. The torch twin of our
    kernel (ops.kv_cache_write_int8): one call instead of these dozen ops, 0.02 ms against 0.66 ms a layer and step."""
    block_size = cache.shape[1]
    blocks = slots // block_size                                                   # [T]
    scale[blocks[slots % block_size == 0]] = 0
    touched = torch.unique(blocks)
    before = scale[touched]                                                        # [U, KV]
    amax = x.abs().amax(-1) / INT8_MAX                                            # [T, KV]
    scale.scatter_reduce_(0, blocks[:, None].expand_as(amax), amax, "amax")        # per block
    after = scale[touched]
    grown = (after > before) & (before > 0)                                        # [U, KV]
    if bool(grown.any()):
        rows = grown.any(1)
        ids = touched[rows]
        ratio = torch.where(grown[rows], before[rows] / after[rows], 1.0)[:, None, :, None]  # [G, 1, KV, 1]
        cache[ids] = torch.round(cache[ids].float() * ratio).to(torch.int8)
    step = scale[blocks].clamp_min(torch.finfo(torch.float32).tiny)[..., None]      # [T, KV, 1]
    cache.view(-1, *x.shape[1:])[slots] = torch.round(x / step).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, num_seqs: int,
            dtype: torch.dtype) -> torch.Tensor:
    num_kv, head_dim = cache.shape[2], cache.shape[3]
    values = cache.index_select(0, block_ids).to(dtype)                            # [S * N, bs, KV, D]
    if scale is not None:
        values = values * scale.index_select(0, block_ids).to(dtype)[:, None, :, None]
    # [S * N, block_size, KV, D] -> [S, N * block_size, KV, D] -> [S, KV, K, D]
    return values.view(num_seqs, -1, num_kv, head_dim).transpose(1, 2)
