"""Paged attention by kind of work: the decodes of a step (one new token per sequence) go through one batched call,
each prefill chunk through a call of its own, so no query row is padding and no mask is bigger than one sequence's
own [new tokens, context]. (One padded [sequences, longest chunk] call made a 512-token chunk beside 15 decodes cost
14x the two apart: benchmarks/attention_step.py.)"""
import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipellm import device, kernels
from pipellm.models.kv_cache import KVCache


@dataclass
class DecodeGroup:
    """The sequences with one new token: Bd of them, N = blocks of the longest context, K = N * block_size."""
    token_idx: torch.Tensor | None  # [Bd] their rows in the step; None when every row is a decode, in order
    block_tables: torch.Tensor      # [Bd, N] int64, their blocks (padding: block 0)
    seq_lens: torch.Tensor          # [Bd] int64, keys in each context, the new token's included
    window: int                     # sliding window, 0 for none
    block_size: int
    built_mask: torch.Tensor | None | bool = False  # the mask once built (False: not yet)

    @property
    def block_ids(self) -> torch.Tensor:
        return self.block_tables.reshape(-1)                                            # [Bd * N]

    @property
    def mask(self) -> torch.Tensor | None:
        """[Bd, 1, 1, K] for the plain-torch path: the query is the last position of its sequence, so the keys up to
        it (and within the window); None when every key is. Built on first use: the kernel's path never needs it."""
        if self.built_mask is False:
            key_pos = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.seq_lens.device)
            mask = key_pos[None, :] < self.seq_lens[:, None]                            # [Bd, K]
            if self.window:
                mask &= key_pos[None, :] >= self.seq_lens[:, None] - self.window
            self.built_mask = None if bool(mask.all()) else mask[:, None, None, :]
        return self.built_mask


@dataclass
class PrefillChunk:
    """One sequence with several new tokens: rows start:end of the step, its own blocks and causal mask."""
    start: int
    end: int
    block_ids: torch.Tensor         # [N] its blocks, the first holding position first_key
    first_key: int
    seq_len: int                    # keys in its context, the new tokens' included
    window: int                     # sliding window, 0 for none
    block_size: int
    num_cached: int = -1            # tokens before the chunk, all visible to it (-1: a sliding window's chunk)
    built_mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """[1, 1, q, K] True where a new token may attend. Built on first use: the causal path never needs it."""
        if self.built_mask is None:  # where its blocks are: a GPU's layers that cannot take the one call build it there
            dev = self.block_ids.device
            key_pos = torch.arange(self.first_key, self.first_key + len(self.block_ids) * self.block_size, device=dev)
            q_pos = torch.arange(self.seq_len - (self.end - self.start), self.seq_len, device=dev)  # after its prefix
            mask = key_pos[None, :] <= q_pos[:, None]                                    # [q, K]
            if self.window:
                mask &= key_pos[None, :] > q_pos[:, None] - self.window
            self.built_mask = mask[None, None]
        return self.built_mask


@dataclass
class VarlenPrefill:
    """Every prefill chunk of a step in one call of SDPA's memory-efficient kernel, on a GPU: the chunks' queries
    and keys packed sequence after sequence, each chunk causal from the bottom right (its last query sees every key
    of its context). Per chunk, a GPU spent ~0.1 ms of host time a layer (two gathers, SDPA's dispatch, a copy)."""
    rows: torch.Tensor | None       # [Tq] the chunks' rows in the step; None when they are all its rows, in order
    key_slots: torch.Tensor         # [Tk] the cache slot of each key
    cu_q: torch.Tensor              # [P + 1] int32, where each chunk's queries start in the packed rows
    cu_k: torch.Tensor              # [P + 1] int32, where its keys start
    max_q: int
    max_k: int

    @classmethod
    def of(cls, prefills: list[PrefillChunk], num_tokens: int) -> "VarlenPrefill | None":
        """None where a chunk needs what the kernel's call here lacks: a sliding window."""
        if not prefills or any(p.window for p in prefills):
            return None
        rows = torch.cat([torch.arange(p.start, p.end) for p in prefills])
        keys = [(p.block_ids[:, None] * p.block_size + torch.arange(p.block_size)).reshape(-1)[:p.seq_len - p.first_key]
                for p in prefills]                                                   # [seq_len - first_key] each
        q_lens, k_lens = [p.end - p.start for p in prefills], [p.seq_len - p.first_key for p in prefills]

        def starts(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0] + lens).cumsum(0).int()
        in_order = len(rows) == num_tokens and bool((rows == torch.arange(num_tokens)).all())
        return cls(None if in_order else rows, torch.cat(keys), starts(q_lens), starts(k_lens), max(q_lens),
                   max(k_lens))


@dataclass
class AttentionMetadata:
    """Per-step view of the batch for attention, built once per step and shared by every layer of a stage."""
    slot_mapping: torch.Tensor      # [T] flat cache slot each new token's K/V is written to
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    query_lens: torch.Tensor        # [S] new tokens per sequence
    seq_lens: torch.Tensor          # [S] each sequence's length after this step
    local: "AttentionMetadata | None" = None  # the sliding-window layers' view, when a model mixes both kinds
    rope_lens: torch.Tensor | None = None  # [S] each sequence's known length (prompt + output); None: seq_lens
    probe: list | None = None       # when inspecting: each layer appends its decode rows' attention weights
    varlen: VarlenPrefill | None = None  # on a GPU: the prefill chunks in one call
    state_rows: torch.Tensor | None = None  # [S] int64 each sequence's row of the linear-attention layers' states
    #                                         (its row of the block tables); None: 0..S-1
    state_saves: dict[int, list[tuple[int, int]]] | None = None  # sequence -> (after how many of its new tokens,
    #                                         slot), in order: where its state is saved (prefix caching)

    @property
    def token_rope_lens(self) -> torch.Tensor:
        """[T] the known length of each token's sequence (dynamic and longrope rotary scale by it)."""
        return torch.repeat_interleave(self.seq_lens if self.rope_lens is None else self.rope_lens, self.query_lens)

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same view with its tensors on device: a GPU stage builds it on the CPU (a few small tensors), then
        moves it."""
        if device.type == "cpu":
            return self
        for m in (self, self.local):  # masks built here, on the CPU (no device sync), and moved with the rest
            if m is None:
                continue
            if m.decode is not None:
                m.decode.mask
            m.varlen = VarlenPrefill.of(m.prefills, len(m.slot_mapping))
            for p in [] if m.varlen is not None else m.prefills:
                p.mask
        moved = _moved(dataclasses.replace(self, local=None), device)
        moved.local = None if self.local is None else moved if self.local is self else self.local.to(device)
        return moved

    @classmethod
    def build(cls, positions: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              sliding_window: int | None = None, decode_chunks: int = 1,
              attention_chunk: int = 0) -> "AttentionMetadata":
        """decode_chunks: chunks of up to this many tokens that continue a cached prefix (speculative decoding's
        drafts) attend as decodes, a row each over the keys up to its own position, in the decode batch.
        attention_chunk: each token attends only to the keys of its own chunk of this many positions (Llama 4's
        chunked layers; a multiple of block_size, so a chunk starts at a block's edge)."""
        # Vector ops for the decodes; a short loop over the prefill chunks (a step holds few).
        starts = torch.cumsum(query_lens, 0) - query_lens
        is_decode = query_lens == 1
        if decode_chunks > 1:
            is_decode |= (query_lens <= decode_chunks) & (seq_lens > query_lens)
        num_decodes = int(is_decode.sum())
        all_decode = num_decodes == len(query_lens)
        decode = None
        if num_decodes and bool((query_lens[is_decode] > 1).any()):  # a row a token: its own context length
            seqs = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # [T] each token's sequence
            rows = None if all_decode else torch.nonzero(is_decode[seqs]).flatten()
            lens = positions + 1 if all_decode else positions[rows] + 1
            num_blocks = -(-int(lens.max()) // block_size)
            decode = DecodeGroup(rows, block_tables[seqs if all_decode else seqs[rows], :num_blocks].long(),
                                 lens.long().contiguous(), sliding_window or 0, block_size)
        elif num_decodes:
            rows = None if all_decode else torch.nonzero(is_decode).flatten()
            lens = seq_lens if all_decode else seq_lens[rows]
            num_blocks = -(-int(lens.max()) // block_size)
            decode = DecodeGroup(None if all_decode else starts[rows],
                                 (block_tables if all_decode else block_tables[rows])[:, :num_blocks].long(),
                                 lens.long().contiguous(), sliding_window or 0, block_size)
        if decode is not None and attention_chunk:
            decode = _within_chunks(decode, attention_chunk)
        prefills = []
        for i in [] if all_decode else torch.nonzero(~is_decode).flatten().tolist():
            q_len, seq_len, start = int(query_lens[i]), int(seq_lens[i]), int(starts[i])
            if attention_chunk:
                prefills += _chunk_prefills(start, q_len, seq_len, block_tables[i], block_size, attention_chunk)
                continue
            num_blocks = -(-seq_len // block_size)
            # with a window, the blocks before the first query's window are skipped, not masked
            first = max(0, seq_len - q_len - sliding_window + 1) // block_size if sliding_window else 0
            prefills.append(PrefillChunk(start, start + q_len, block_tables[i, first:num_blocks].long(),
                                         first * block_size, seq_len, sliding_window or 0, block_size,
                                         -1 if sliding_window else seq_len - q_len))
        return cls(slot_mapping, decode, prefills, query_lens, seq_lens)

    @classmethod
    def for_layers(cls, is_sliding: list[bool], sliding_window: int | None, *args,
                   window_tables: torch.Tensor | None = None, decode_chunks: int = 1,
                   attention_chunk: int = 0) -> "AttentionMetadata":
        """The metadata of full-attention layers, with that of the local ones (sliding, or chunked with
        attention_chunk) in .local (itself when all are local). args: as build's, up to block_size. window_tables
        [S, ring]: the sliding layers' own block rings."""
        full = cls.build(*args, decode_chunks=decode_chunks) if not all(is_sliding) or not is_sliding else None
        local = None
        if any(is_sliding):
            local_args = args if window_tables is None else _ring_view(window_tables, *args)
            local = cls.build(*local_args, sliding_window, decode_chunks=decode_chunks,
                              attention_chunk=attention_chunk)
        meta = full or local
        meta.local = local
        return meta


def _moved(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_moved(o, device) for o in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def _within_chunks(d: DecodeGroup, chunk: int) -> DecodeGroup:
    """The decodes seen by chunked layers: each row's blocks from its chunk's first one, its length counted from
    there, so that every kernel runs them as full attention over the chunk's keys."""
    first = (d.seq_lens - 1) // chunk * (chunk // d.block_size)                          # [Bd] the chunk's first block
    lens = d.seq_lens - first * d.block_size
    num_blocks = -(-int(lens.max()) // d.block_size)
    idx = (first[:, None] + torch.arange(num_blocks, device=first.device)).clamp(max=d.block_tables.shape[1] - 1)
    return dataclasses.replace(d, block_tables=d.block_tables.gather(1, idx), seq_lens=lens)       # [Bd, N']


def _chunk_prefills(start: int, q_len: int, seq_len: int, table: torch.Tensor, block_size: int,
                    chunk: int) -> list[PrefillChunk]:
    """A sequence's new tokens split where an attention chunk ends: each part causal over the keys of its chunk
    only (the earlier ones in its chunk as a cached prefix)."""
    parts, pos = [], seq_len - q_len
    while pos < seq_len:
        first, end = pos // chunk * chunk, min(seq_len, pos // chunk * chunk + chunk)
        row = start + pos - (seq_len - q_len)
        parts.append(PrefillChunk(row, row + end - pos, table[first // block_size:-(-end // block_size)].long(),
                                  first, end, 0, block_size, pos - first))
        pos = end
    return parts


def _ring_view(rings: torch.Tensor, positions, query_lens, seq_lens, block_tables, slot_mapping, block_size):
    """build()'s arguments for layers whose sequences cycle through rings of blocks: logical block j of a sequence
    lives in ring slot j % ring. Blocks that alias older positions are outside the window, masked or skipped."""
    ring = rings.shape[1]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    tables = rings[:, torch.arange(num_blocks) % ring]                                   # [S, N]
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)            # [T] each token's sequence
    slots = rings[rows, (positions // block_size) % ring].long() * block_size + positions % block_size
    return positions, query_lens, seq_lens, tables, slots, block_size


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; the layer's cache holds [num_blocks, block_size, KV, D]. Returns [T, H, D].
    softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2). sinks [H]: a logit per head
    that joins each softmax's denominator and weighs no value (GPT-OSS): decodes take them in our C++ kernel, the
    rest SDPA's CPU kernel, corrected by its log-sum-exp; a GPU's by scores computed by hand, as HF's eager
    attention."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    cache.write(meta.slot_mapping, k, v)
    if meta.probe is not None and meta.decode is not None:
        d = meta.decode
        meta.probe.append(decode_attention_weights(q if d.token_idx is None else q[d.token_idx], cache, d,
                                                   scale, softcap, sinks))
    out = None if meta.decode is not None and meta.decode.token_idx is None else torch.empty_like(q)
    if meta.decode is not None:
        d = meta.decode
        rows = q if d.token_idx is None else q[d.token_idx]
        num_seqs = len(rows)
        ops, o = decode_kernels(q), None
        if ops is not None:  # reads K/V in place through the block tables: no gathered copy. It computes in fp32:
            # bf16 rows are widened (a few KB), which costs far less than torch's SDPA on gathered bf16 K/V
            try:
                o = ops.paged_decode_attention(rows.float().contiguous(), cache.k, cache.v, cache.k_scale,
                                               cache.v_scale, d.block_tables, d.seq_lens, d.window, scale,
                                               softcap or 0.0, "", None if sinks is None else
                                               sinks.float().contiguous()).to(q.dtype)         # [Bd, H, D]
            except Exception as e:
                # our C++ kernels were built and checked here: a failure is a bug (for_tensor, not load(): a GPU
                # stage never loads them, and would build them now)
                if ops is kernels.for_tensor(q):
                    raise
                kernels.gpu_failed(e)
        if o is None:
            queries = rows.view(num_seqs, 1, num_heads, head_dim).transpose(1, 2)      # [Bd, H, 1, D]
            ids = d.block_ids
            o = _attend(queries, cache.keys(ids, num_seqs, q.dtype), cache.values(ids, num_seqs, q.dtype), d.mask,
                        scale, softcap, sinks)                                         # [Bd, H, 1, D]
            o = o.view(num_seqs, num_heads, head_dim)
        if out is None:
            return o
        out[d.token_idx] = o
    if meta.varlen is not None and softcap is None and sinks is None and cache.k_scale is None:
        o = _attend_varlen(q if meta.varlen.rows is None else q[meta.varlen.rows], cache, meta.varlen, scale)
        if meta.varlen.rows is None:
            return o
        out[meta.varlen.rows] = o
        return out
    with device.prefill_attention_backends(q.device) if meta.prefills else contextlib.nullcontext():
        for p in meta.prefills:
            queries = q[p.start:p.end].transpose(0, 1)[None]                            # [1, H, q, D]
            if p.num_cached >= 0 and softcap is None and sinks is None and q.is_cpu \
                    and q.dtype == cache.k.dtype == torch.float32:
                o = _attend_causal(queries, k[p.start:p.end], v[p.start:p.end], cache, p, scale)
            else:
                o = _attend(queries, cache.keys(p.block_ids, 1, q.dtype), cache.values(p.block_ids, 1, q.dtype),
                            p.mask, scale, softcap, sinks)                             # [1, H, q, D]
            out[p.start:p.end] = o[0].transpose(0, 1)
    return out


def decode_kernels(q: torch.Tensor):
    """The kernels whose paged_decode_attention reads K/V in place: our C++ ones on a CPU, Triton's on a GPU; None
    where neither runs (the decodes then gather their blocks for SDPA)."""
    if q.is_cuda:
        return kernels.gpu()
    return kernels.for_tensor(q) if q.dtype in (torch.float32, torch.bfloat16) else None


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, p: PrefillChunk,
                   scale: float) -> torch.Tensor:
    """A chunk without a window in an fp32 cache: its own keys (k/v [q, KV, D], the values it wrote) causally, where
    SDPA skips the masked half and needs no gather or mask, and the cached prefix's keys unmasked; the two parts
    merged by their log-sum-exp. q [1, H, q, D] -> [1, H, q, D]."""
    own_k, own_v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]                   # [1, KV, q, D]
    if p.num_cached == 0:
        return F.scaled_dot_product_attention(q, own_k, own_v, is_causal=True, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel, with its log-sum-exp
    o_own, lse_own = flash(q, own_k, own_v, 0.0, True, scale=scale)                   # [1, H, q, D], [1, H, q]
    blocks = p.block_ids[:-(-p.num_cached // cache.k.shape[1])]
    prefix_k = cache.keys(blocks, 1, q.dtype)[:, :, :p.num_cached]                   # [1, KV, cached, D]
    prefix_v = cache.values(blocks, 1, q.dtype)[:, :, :p.num_cached]
    o_pre, lse_pre = flash(q, prefix_k, prefix_v, 0.0, False, scale=scale)
    top = torch.maximum(lse_own, lse_pre)
    w_own, w_pre = (lse_own - top).exp()[..., None], (lse_pre - top).exp()[..., None]   # [1, H, q, 1]
    return (o_own * w_own + o_pre * w_pre) / (w_own + w_pre)


def decode_attention_weights(q: torch.Tensor, cache: KVCache, d: DecodeGroup, scale: float,
                             softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, H, D] -> [Bd, H, K] float32: each decode row's attention weights over its cached keys (positions
    past its context, or before its window, get 0). For inspection, off the hot path."""
    num_seqs, num_heads = q.shape[0], q.shape[1]
    keys = cache.keys(d.block_ids, num_seqs, torch.float32)                            # [Bd, KV, K, D]
    keys = keys.repeat_interleave(num_heads // keys.shape[1], dim=1)                   # [Bd, H, K, D]
    scores = (keys @ q.float()[..., None]).squeeze(-1) * scale                         # [Bd, H, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(scores.shape[-1], device=scores.device)
    visible = key_pos[None, :] < d.seq_lens[:, None]                                   # [Bd, K]
    if d.window:
        visible &= key_pos[None, :] >= d.seq_lens[:, None] - d.window
    return _softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), sinks)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of scores [B, H, q, K] or [B, H, K] in fp32; with sinks [H], each head's sink logit
    joins the denominator (as HF GPT-OSS: max-subtracted over keys and sink, the sink's column then dropped)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.to(scores.dtype).view(-1, *[1] * (scores.dim() - 2)).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1).float()                               # [..., K + 1]
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def _attend_varlen(q: torch.Tensor, cache: KVCache, v: VarlenPrefill, scale: float) -> torch.Tensor:
    """q [Tq, H, D] of every chunk -> [Tq, H, D]: one call of the memory-efficient kernel over their packed keys."""
    num_kv, head_dim = cache.k.shape[2], cache.k.shape[3]
    keys = cache.k.view(-1, num_kv, head_dim).index_select(0, v.key_slots).to(q.dtype)          # [Tk, KV, D]
    values = cache.v.view(-1, num_kv, head_dim).index_select(0, v.key_slots).to(q.dtype)
    if num_kv != q.shape[1]:  # the kernel takes as many K/V heads as query heads
        keys, values = _repeat_heads(keys, q.shape[1]), _repeat_heads(values, q.shape[1])      # [Tk, H, D]
    bottom_right_causal = 2
    out = torch.ops.aten._efficient_attention_forward(
        q.contiguous()[None], keys.contiguous()[None], values.contiguous()[None], None, v.cu_q, v.cu_k, v.max_q,
        v.max_k, 0.0, bottom_right_causal, False, scale=scale)[0]                               # [1, Tq, H, D]
    return out[0]


def _repeat_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, KV, ...] -> [B, H, ...], each KV head for its group of query heads (repeat_interleave's result on dim 1,
    by an expand: no host sync, which a CUDA graph's capture refuses)."""
    b, kv, *rest = x.shape
    return x[:, :, None].expand(b, kv, num_heads // kv, *rest).reshape(b, num_heads, *rest)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, q, D], k/v [B, KV, K, D], mask [B, 1, q, K] or None. Returns [B, H, q, D]."""
    if sinks is not None and softcap is None and q.is_cpu:
        # SDPA's CPU kernel and its log-sum-exp: a sink scales each row's output by sum / (sum + exp(sink)) =
        # sigmoid(lse - sink), and no [q, K] scores are held (by hand: 1 GiB for 512 queries at 8,192 keys, 64 heads)
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                              scale=scale)  # lse [B, H, q]
        return (o * torch.sigmoid(lse - sinks.float()[:, None])[..., None]).to(q.dtype)
    gqa = k.shape[1] != q.shape[1]
    by_hand = softcap is not None or sinks is not None  # SDPA has neither soft-capping nor sinks
    # CUDA's fused kernels take a mask (memory-efficient) or grouped heads (flash), not both: SDPA would fall back to
    # its unfused math, so the heads are repeated instead
    if gqa and (by_hand or mask is not None and q.is_cuda):
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])              # [B, H, K, D]
        gqa = False
    if not by_hand:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    scores = q @ k.transpose(-1, -2) * scale                                            # [B, H, q, K]
    if softcap is not None:  # in HF Gemma 2's order
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _softmax(scores, sinks).to(q.dtype) @ v
