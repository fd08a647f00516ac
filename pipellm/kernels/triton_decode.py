"""A GPU's paged decode attention, in Triton: each decode row reads its K/V in place through its block table, as our
C++ kernel does on a CPU (the same call, ops.paged_decode_attention), with no gathered copy padded to the longest
context. A context is split over several programs, whose parts are merged by their running maxima (flash-decoding):
past SPLIT_KEYS keys, and wherever a program a sequence and KV head would leave the GPU's units idle.

The tests run these kernels on the CPU in Triton's interpreter (TRITON_INTERPRET=1) against the dense reference
(test_attention.py), and compile them for NVIDIA GPUs with Triton's own ptxas (test_triton_compile.py)."""
import functools

import torch
import triton
import triton.language as tl

SPLIT_KEYS = 512  # keys a program reads at most (vLLM's partition)
MIN_SPLIT_BLOCKS = 4  # blocks a program reads at least, where a context is split only to fill the GPU


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, sinks_ptr, out_ptr, part_ptr, stats_ptr,
            table_width, window, scale, softcap, blocks_per_split,
            H: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr,
            D_P: tl.constexpr, BS: tl.constexpr, BS_P: tl.constexpr, INT8: tl.constexpr, SOFTCAP: tl.constexpr,
            SPLIT: tl.constexpr, DOT: tl.constexpr, SINKS: tl.constexpr):
    """One program: sequence b, KV head h (its GROUP query heads together), split s of the context's blocks.
    DOT: the group's scores and weighted values as matrix products (GROUP_P, D_P, BS_P >= 16), on the tensor cores
    in the cache's 16-bit type (int8 codes are exact in bf16, their scales applied after) and in fp32 for an fp32
    cache; else as products broadcast in registers, for a group of one head. SINKS (GPT-OSS): each head's sink logit
    joins its softmax's denominator, here where the context is whole, else in _merge."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first key the row sees
    lo = tl.maximum(first // BS, s * blocks_per_split)
    hi = tl.minimum((seq_len + BS - 1) // BS, (s + 1) * blocks_per_split)
    g, d, t = tl.arange(0, GROUP_P), tl.arange(0, D_P), tl.arange(0, BS_P)
    heads = h * GROUP + g                                                         # [G] query heads of KV head h
    qd_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    LOW: tl.constexpr = DOT and k_ptr.dtype.element_ty != tl.float32
    OPERAND: tl.constexpr = (tl.bfloat16 if INT8 else k_ptr.dtype.element_ty) if LOW else tl.float32
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=qd_mask, other=0.0).to(OPERAND)  # [G, D]
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    for j in range(lo, hi):
        block = tl.load(tables_ptr + b * table_width + j).to(tl.int64)
        pos = j * BS + t
        seen = (t < BS) & (pos >= first) & (pos < seq_len)                       # [BS]
        rows = ((block * BS + t) * KV + h)[:, None] * D + d[None, :]             # [BS, D] into [blocks, BS, KV, D]
        td_mask = seen[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + rows, mask=td_mask, other=0.0)
        v = tl.load(v_ptr + rows, mask=td_mask, other=0.0)
        if INT8:  # codes by way of fp32 (exact in both): Triton's interpreter casts int8 to bf16 by their bits
            k, v = k.to(tl.float32), v.to(tl.float32)
        k, v = k.to(OPERAND), v.to(OPERAND)
        k_scale = tl.load(ks_ptr + block * KV + h) if INT8 else 1.0
        v_scale = tl.load(vs_ptr + block * KV + h) if INT8 else 1.0
        if DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")              # [G, BS]
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = scores * (scale * k_scale)
        if SOFTCAP:  # softcap * tanh(scores / softcap), as 2 * sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(seen[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, axis=1))                              # finite: a block holds a seen key
        p = tl.exp(scores - top[:, None])                                         # [G, BS]
        rescale = tl.exp(m - top)
        total = total * rescale + tl.sum(p, axis=1)
        if DOT:
            values = tl.dot(p.to(OPERAND), v, input_precision="ieee")            # [G, D]
        else:
            values = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * rescale[:, None] + values * v_scale
        m = top
    if SPLIT:  # this split's unnormalised sum, maximum and total, for _merge (a split with no keys: 0, -inf, 0)
        part = ((b * tl.num_programs(2) + s) * H + heads)
        tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=qd_mask)
        tl.store(stats_ptr + part * 2, m, mask=g < GROUP)
        tl.store(stats_ptr + part * 2 + 1, total, mask=g < GROUP)
    else:
        if SINKS:  # exp(sink) in the denominator, both sides scaled to the larger of the maximum and the sink
            sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0)
            top = tl.maximum(m, sink)
            acc, total = acc * tl.exp(m - top)[:, None], total * tl.exp(m - top) + tl.exp(sink - top)
        tl.store(out_ptr + (b * H + heads)[:, None] * D + d[None, :], acc / total[:, None], mask=qd_mask)


@triton.jit
def _merge(part_ptr, stats_ptr, sinks_ptr, out_ptr, num_splits, H: tl.constexpr, D: tl.constexpr,
           D_P: tl.constexpr, SPLITS_P: tl.constexpr, SINKS: tl.constexpr):
    """One program per sequence b and query head h: its splits' parts, each rescaled to their common maximum (or
    the head's sink, where it is larger), and the sink's exp in the denominator."""
    b, h = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SPLITS_P), tl.arange(0, D_P)
    part = (b * num_splits + s) * H + h                                           # [S]
    top = tl.load(stats_ptr + part * 2, mask=s < num_splits, other=float("-inf"))
    most = tl.max(top, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + h)
        most = tl.maximum(most, sink)
    w = tl.exp(top - most)                                                        # [S], 0 for a split with no keys
    total = tl.sum(w * tl.load(stats_ptr + part * 2 + 1, mask=s < num_splits, other=0.0), axis=0)
    if SINKS:
        total += tl.exp(sink - most)
    sd_mask = (s[:, None] < num_splits) & (d[None, :] < D)
    acc = tl.sum(w[:, None] * tl.load(part_ptr + part[:, None] * D + d[None, :], mask=sd_mask, other=0.0), axis=0)
    tl.store(out_ptr + (b * H + h) * D + d, acc / total, mask=d < D)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window: int, scale: float, softcap: float,
                           isa: str = "", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] fp32 -> [B, H, D] fp32: row b attends over the keys before seq_lens[b] ([B] int64; the last
    `window` of them where window > 0), through block_tables [B, width] int64 into the caches [blocks, block_size,
    KV, D] (fp32, bf16, fp16, or int8 with scales [blocks, KV]). softcap 0: none. The C++ kernel's call; isa is the
    CPU's, unused here. Ids and lengths are not checked against the cache, as the C++ kernel does: that would wait
    for the GPU, and a CUDA graph's capture refuses it (the block manager hands out only the cache's blocks).
    sinks [H] fp32 (GPT-OSS): a logit per head in each softmax's denominator."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    if not (q.dtype == torch.float32 and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and num_heads % num_kv == 0):
        raise ValueError("q must be contiguous fp32 [B, H, D], the caches contiguous [blocks, block_size, KV, D] "
                         "alike, and H a multiple of KV")
    int8 = k_cache.dtype == torch.int8
    if int8 != (k_scale is not None) or int8 != (v_scale is not None):
        raise ValueError("int8 caches, and only they, need scales")
    if block_tables.dtype != torch.int64 or not block_tables.is_contiguous() or block_tables.shape[0] != num_seqs \
            or seq_lens.dtype != torch.int64 or seq_lens.shape != (num_seqs,):
        raise ValueError("block_tables must be contiguous int64 [B, width], seq_lens int64 [B]")
    if sinks is not None and not (sinks.dtype == torch.float32 and sinks.shape == (num_heads,)):
        raise ValueError("sinks must be fp32 [H]")
    num_splits, blocks_per_split = _splits(num_seqs, num_kv, block_tables.shape[1], block_size, q.device)
    out = torch.empty_like(q)
    split = num_splits > 1
    part = torch.empty(num_seqs, num_splits, num_heads, head_dim, device=q.device) if split else out
    stats = torch.empty(num_seqs, num_splits, num_heads, 2, device=q.device) if split else out
    _decode[(num_seqs, num_kv, num_splits)](
        q, k_cache, v_cache, k_scale if int8 else q, v_scale if int8 else q, block_tables, seq_lens,
        q if sinks is None else sinks, out, part, stats, block_tables.shape[1], window, scale, softcap,
        blocks_per_split, INT8=int8, SOFTCAP=softcap > 0, SPLIT=split, SINKS=sinks is not None,
        **_config(num_heads, num_kv, head_dim, block_size))
    if split:
        _merge[(num_seqs, num_heads)](part, stats, q if sinks is None else sinks, out, num_splits, H=num_heads,
                                      D=head_dim, D_P=triton.next_power_of_2(head_dim),
                                      SPLITS_P=triton.next_power_of_2(num_splits), SINKS=sinks is not None)
    return out


def _config(num_heads: int, num_kv: int, head_dim: int, block_size: int) -> dict:
    """_decode's shapes and warps. A group of query heads shares each K/V read in matrix products (as vLLM's and
    SGLang's decode kernels do); one head a group takes broadcast products. Warps by what a program holds in
    registers (ptxas spills none at the shapes of tests/test_triton_compile.py)."""
    group = num_heads // num_kv
    dot = group > 1
    least = 16 if dot else 2  # a product's smallest side; else arange's
    d_p, group_p, bs_p = (max(least, triton.next_power_of_2(n)) for n in (head_dim, group, block_size))
    warps = (8 if d_p >= 256 else 4) if dot else (8 if group_p * bs_p * d_p >= 16384 else 4)
    return dict(H=num_heads, KV=num_kv, GROUP=group, GROUP_P=group_p, D=head_dim, D_P=d_p, BS=block_size,
                BS_P=bs_p, DOT=dot, num_warps=warps)


def _splits(num_seqs: int, num_kv: int, width: int, block_size: int, device: torch.device) -> tuple[int, int]:
    """(splits, blocks a split) of contexts `width` blocks wide: SPLIT_KEYS keys a program at most, and more splits
    (of MIN_SPLIT_BLOCKS at least) where fewer programs than _units would run. From shapes alone: a CUDA graph's
    are fixed."""
    least = triton.cdiv(width, max(1, SPLIT_KEYS // block_size))
    to_fill = min(triton.cdiv(_units(device), num_seqs * num_kv), triton.cdiv(width, MIN_SPLIT_BLOCKS))
    per_split = triton.cdiv(width, max(least, to_fill))
    return triton.cdiv(width, per_split), per_split


@functools.cache
def _units(device: torch.device) -> int:
    """Programs that keep a GPU busy: two a streaming multiprocessor (flash-decoding's rule); one on a CPU, where
    Triton's interpreter runs them in turn."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
