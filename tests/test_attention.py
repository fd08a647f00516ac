"""Paged attention of every kind of step against a dense reference computed from each sequence's full K/V: ragged
lengths, shuffled block tables, cached prefixes, mixed steps, sliding windows, grouped-query heads."""
import math

import pytest
import torch

from pipellm import kernels
from pipellm.models.attention import AttentionMetadata, VarlenPrefill, paged_attention
from pipellm.models.kv_cache import KVCache, _write_int8

BLOCK = 4


@pytest.fixture(autouse=True, params=["kernel", "torch", "triton"])
def decode_path(request, monkeypatch):
    """Decode rows through our C++ kernels (K/V read in place, int8 written), through the plain-torch twins, and
    through a GPU's Triton kernels, which Triton's interpreter runs here on the CPU, as on a GPU of 32 units with
    parts of at most 32 keys: the short contexts in one part, the middling ones split to fill the units, the long
    ones at 32 keys a part (a GPU's: 512)."""
    if request.param == "torch":
        none = type("NoKernels", (), {"load": staticmethod(lambda: None), "for_tensor": staticmethod(lambda x: None)})
        monkeypatch.setattr("pipellm.models.attention.kernels", none)
        monkeypatch.setattr("pipellm.models.kv_cache.kernels", none)
    elif request.param == "triton":
        gpu = interpreted_gpu_kernels(monkeypatch)
        monkeypatch.setattr(gpu, "SPLIT_KEYS", 32)
        monkeypatch.setattr(gpu, "_units", lambda device: 32)
        calls, failures = [], []
        monkeypatch.setattr("pipellm.models.attention.decode_kernels", lambda q: calls.append(1) or gpu)
        monkeypatch.setattr(kernels, "GPU_FAILURE", failures)
        yield
        name = request.node.name  # every paged attention step with decode rows sent them through it, and it ran
        assert calls or not ("paged_attention" in name and ("decode" in name or "mixed" in name))
        assert not failures, failures
        return
    else:
        assert kernels.load() is not None
    yield


def interpreted_gpu_kernels(monkeypatch):
    """pipellm.kernels.triton_decode with its kernels run by Triton's interpreter, on the CPU tensors given them
    (conftest.py sets TRITON_INTERPRET where no GPU is). The interpreter holds bf16 as its bits (uint16), and its
    tl.dot multiplies those (triton-lang/triton#11584, not supported yet): here it takes bf16 operands by their
    values, as a GPU's tensor cores do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    import pipellm.kernels.triton_decode as gpu
    assert type(gpu._decode).__name__ == "InterpretedFunction", "TRITON_INTERPRET=1 must be set before triton loads"
    dot = interpreter.InterpreterBuilder.create_dot

    def as_fp32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle(interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
                                        .view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: dot(self, as_fp32(a), as_fp32(b), *rest))
    return gpu


def _dense(q, keys, values, q_pos, window, softcap=None, sinks=None, chunk=0):
    """q [q, H, D] at positions q_pos; keys/values [S, KV, D] for positions 0..S-1. Softmax over allowed keys;
    softcap: scores capped to softcap * tanh(scores / softcap) first (Gemma 2); sinks [H]: exp(sink) added to each
    head's denominator (GPT-OSS); chunk: keys of the query's own chunk of positions only (Llama 4)."""
    heads, kv = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv, dim=1)           # [S, H, D]
    values = values.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos = torch.arange(len(keys))
    allowed = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    if chunk:
        allowed &= key_pos[None, :] >= q_pos[:, None] // chunk * chunk
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + (0 if sinks is None else
                                                                    sinks.double().exp()[:, None, None]))
    return torch.einsum("hqk,khd->qhd", weights, values.double()).float()


def _run(steps: list[tuple[int, int]], heads: int, kv_heads: int, window: int | None, seed: int,
         kv_dtype: torch.dtype = torch.float32, dim: int = 8, act_dtype: torch.dtype = torch.float32,
         softcap: float | None = None, decode_chunks: int = 1, parts: bool = False, device: str = "cpu",
         sinks: torch.Tensor | None = None, chunk: int = 0):
    """steps: (cached tokens, new tokens) per sequence. Returns paged and dense outputs of the step. act_dtype: the
    activations' (q and the new K/V); the reference sees the same values, rounded to it. device: where the paged
    attention runs (benchmarks/gpu_check.py runs these on a GPU)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(act_dtype).float()

    num_blocks = max(64, 1 + sum(-(-(c + n) // BLOCK) for c, n in steps))
    cache = KVCache.allocate(num_blocks, BLOCK, kv_heads, dim, kv_dtype)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()   # block 0 stays unused padding
    width = max(-(-(c + n) // BLOCK) for c, n in steps)
    tables = torch.zeros(len(steps), width, dtype=torch.int32)
    full_k, full_v, positions, slots, qs = [], [], [], [], []
    for i, (cached, new) in enumerate(steps):
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        keys, values = randn(total, kv_heads, dim), randn(total, kv_heads, dim)
        if cached:  # the cached prefix is in the cache already, written by an earlier step
            cache.write(torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)]),
                        keys[:cached], values[:cached])
        full_k.append(keys)
        full_v.append(values)
        positions += list(range(cached, total))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        qs.append(randn(new, heads, dim))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, steps)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, steps)])
    q = torch.cat(qs)
    meta = AttentionMetadata.build(torch.tensor(positions), torch.tensor([n for _, n in steps]),
                                   torch.tensor([c + n for c, n in steps]), tables, torch.tensor(slots), BLOCK, window,
                                   decode_chunks, chunk)
    if parts:  # what a step's attention reads, for tests of the metadata
        return meta, cache, full_k, full_v
    if device != "cpu":
        cache = KVCache(*(None if t is None else t.to(device)
                          for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)))
        meta = meta.to(torch.device(device))
        q, new_k, new_v = (x.to(device) for x in (q, new_k, new_v))
    out = paged_attention(*(x.to(act_dtype) for x in (q, new_k, new_v)), cache, meta, dim ** -0.5, softcap,
                          None if sinks is None else sinks.to(q.device)).cpu()
    dense = torch.cat([_dense(qi, k, v, torch.arange(c, c + n), window, softcap, sinks, chunk)
                       for qi, k, v, (c, n) in zip(qs, full_k, full_v, steps)])
    return out, dense


STEPS = {
    "decode, equal lengths": [(11, 1), (11, 1), (11, 1)],
    "decode, ragged": [(3, 1), (17, 1), (0, 1), (8, 1)],
    "decode, long contexts": [(300, 1), (5, 1), (130, 1)],  # the kernel splits these into chunks of positions
    "prefill, whole prompts": [(0, 7), (0, 1 + BLOCK * 3), (0, 2)],
    "chunks after cached prefixes": [(5, 6), (BLOCK * 2, 3), (13, 9)],
    "mixed": [(9, 1), (0, 10), (4, 1), (6, 5), (21, 1)],
    "one long chunk and decodes": [(0, 40), (30, 1), (2, 1)],
}


@pytest.mark.parametrize("name", ["prefill, whole prompts", "chunks after cached prefixes", "mixed",
                                  "one long chunk and decodes"])
def test_varlen_prefill_packs_each_chunks_context(name):
    """A GPU's one call for every prefill chunk of a step (VarlenPrefill, its kernel checked by
    benchmarks/gpu_check.py): the packed keys are each chunk's whole context in order, its cached prefix then its own,
    and the packed rows are the chunk's rows of the step."""
    steps = STEPS[name]
    meta, cache, full_k, full_v = _run(steps, 6, 2, None, seed=5, parts=True)
    # the cache holds the step's own K/V before attention reads it
    cache.write(meta.slot_mapping, *(torch.cat([x[c:] for x, (c, _) in zip(full, steps)]) for full in (full_k, full_v)))
    packed = VarlenPrefill.of(meta.prefills, len(meta.slot_mapping))
    chunks = [i for i, (_, n) in enumerate(steps) if n > 1]
    starts = torch.tensor([0] + [n for _, n in steps]).cumsum(0)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chunks])
    assert torch.equal(rows, torch.arange(len(meta.slot_mapping))) if packed.rows is None else \
        torch.equal(packed.rows, rows)
    assert packed.cu_q.tolist() == [0, *torch.tensor([steps[i][1] for i in chunks]).cumsum(0).tolist()]
    assert packed.max_k == max(sum(steps[i]) for i in chunks)
    flat_k, flat_v = cache.k.view(-1, *cache.k.shape[2:]), cache.v.view(-1, *cache.v.shape[2:])
    for j, i in enumerate(chunks):
        slots = packed.key_slots[packed.cu_k[j]:packed.cu_k[j + 1]]
        assert torch.equal(flat_k[slots], full_k[i]) and torch.equal(flat_v[slots], full_v[i])


KV_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.int8, 4e-2)]  # tolerance: values ~N(0, 1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_paged_attention_equals_dense_reference(name, heads, kv_heads, window, kv_dtype, atol):
    """The dense reference sees the exact K/V; bf16 and int8 caches hold them rounded (values ~N(0, 1))."""
    out, dense = _run(STEPS[name], heads, kv_heads, window, seed=len(name), kv_dtype=kv_dtype)
    assert out.shape == dense.shape
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)


CHUNKED_STEPS = {  # BLOCK * 2 positions a chunk: contexts that end in their first, second and later chunks
    "decodes at and past chunk edges": [(7, 1), (8, 1), (15, 1), (16, 1), (300, 1), (2, 1)],
    "prompts over several chunks": [(0, 21), (0, 8), (0, 3)],
    "chunks after cached prefixes": [(5, 6), (BLOCK * 2, 3), (13, 9), (16, 16)],
    "mixed": [(9, 1), (0, 10), (4, 1), (6, 5), (21, 1), (130, 1)],
}


@pytest.mark.parametrize("name", list(CHUNKED_STEPS))
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_chunked_attention_sees_its_own_chunk_only(name, kv_dtype, atol):
    """Llama 4's chunked layers: each query attends to the keys of its own chunk of positions up to itself, decodes
    and prefill chunks that start, end or cross a chunk's edge alike; speculative drafts as decode rows too."""
    out, dense = _run(CHUNKED_STEPS[name], 6, 2, None, seed=7, kv_dtype=kv_dtype, chunk=BLOCK * 2)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)
    out, dense = _run(CHUNKED_STEPS[name], 6, 2, None, seed=8, kv_dtype=kv_dtype, chunk=BLOCK * 2, decode_chunks=4)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("steps", [[(9, 5), (20, 5), (3, 2)], [(9, 5), (0, 7), (4, 1), (13, 3), (2, 6)]],
                         ids=["drafts only", "drafts, prompts and decodes"])
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_speculative_drafts_attend_as_decode_rows(steps, window, kv_dtype, atol):
    """Chunks of up to decode_chunks tokens after a cached prefix (a token and its drafts) run in the decode batch,
    a row a token over the keys up to its own position; longer chunks and new prompts stay prefills."""
    out, dense = _run(steps, 6, 2, window, seed=3, kv_dtype=kv_dtype, decode_chunks=5)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)
    positions = torch.cat([torch.arange(c, c + n) for c, n in steps])
    tables, slots = torch.zeros(len(steps), 8, dtype=torch.int32), torch.zeros(len(positions), dtype=torch.long)
    meta = AttentionMetadata.build(positions, torch.tensor([n for _, n in steps]),
                                   torch.tensor([c + n for c, n in steps]), tables, slots, BLOCK, window, 5)
    as_decodes = [c > 0 and n <= 5 or n == 1 for c, n in steps]
    assert meta.decode.seq_lens.tolist() == [p + 1 for p, d in zip(positions.tolist(), torch.repeat_interleave(
        torch.tensor(as_decodes), torch.tensor([n for _, n in steps])).tolist()) if d]
    assert len(meta.prefills) == as_decodes.count(False)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("name", ["decode, ragged", "decode, long contexts", "mixed"])
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_paged_attention_at_a_real_head_size(name, heads, kv_heads, kv_dtype, atol):
    """head_dim 64, as the default model's: the kernel's vector paths, with 1 to 4 query heads a KV head (it takes
    them in groups of up to three)."""
    out, dense = _run(STEPS[name], heads, kv_heads, None, seed=len(name), kv_dtype=kv_dtype, dim=64)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_paged_attention_with_soft_capped_scores(name, window, kv_dtype, atol):
    """Gemma 2's soft-capped scores (a cap of 0.5 bends every score of this data), grouped-query heads."""
    out, dense = _run(STEPS[name], 6, 2, window, seed=len(name), kv_dtype=kv_dtype, softcap=0.5)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
def test_paged_attention_with_sinks(name, window, kv_dtype, atol):
    """GPT-OSS's sinks: a logit per head in each softmax's denominator, through sequences split into the kernel's
    chunks too, grouped-query heads."""
    sinks = torch.tensor([-1.0, 0.0, 1.0, 2.0, 3.0, 4.0])
    out, dense = _run(STEPS[name], 6, 2, window, seed=len(name), kv_dtype=kv_dtype, sinks=sinks)
    torch.testing.assert_close(out, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("sinks", [None, torch.linspace(-1, 3, 6)], ids=["", "sinks"])
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_with_16_bit_activations(name, dtype, atol, sinks):
    """dtype="bfloat16" (or "float16", a GPU's without bf16): q and the new K/V arrive in it, the cache holds it, the
    output is in it; with GPT-OSS's sinks too."""
    out, dense = _run(STEPS[name], 6, 2, None, seed=len(name), kv_dtype=dtype, act_dtype=dtype, sinks=sinks)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), dense, atol=atol, rtol=0)


def _round_trip(cache: KVCache, blocks: list[int], num_tokens: int) -> torch.Tensor:
    k = cache.keys(torch.tensor(blocks), 1, torch.float32)                       # [1, KV, K, D]
    return k[0].transpose(0, 1)[:num_tokens]                                       # [T, KV, D]


def test_int8_cache_rescales_a_block_when_a_larger_token_arrives():
    """Decode writes one token at a time; each larger than the last raises the block's scale, and the tokens
    already there are re-rounded to it: every token stays within a step of the final scale."""
    cache = KVCache.allocate(4, BLOCK, 2, 8, torch.int8)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(BLOCK, 2, 8, generator=gen) * torch.tensor([0.01, 0.1, 1.0, 10.0])[:, None, None]
    for p in range(BLOCK):
        cache.write(torch.tensor([2 * BLOCK + p]), keys[p:p + 1], keys[p:p + 1])
    step = keys.abs().amax((0, 2)) / 127                                           # [KV] per head
    assert ((_round_trip(cache, [2], BLOCK) - keys).abs() <= step[None, :, None] * 1.01).all()


def test_int8_cache_starts_a_reused_block_afresh():
    """A freed block's next owner writes from offset 0: the old owner's large scale must not coarsen its values."""
    cache = KVCache.allocate(2, BLOCK, 1, 8, torch.int8)
    big, small = torch.full((BLOCK, 1, 8), 100.0), torch.randn(BLOCK, 1, 8) * 0.01
    slots = torch.arange(BLOCK, 2 * BLOCK)
    cache.write(slots, big, big)
    cache.write(slots[:2], small[:2], small[:2])  # a prefill chunk, then a decode
    cache.write(slots[2:3], small[2:3], small[2:3])
    assert ((_round_trip(cache, [1], 3) - small[:3]).abs() <= small[:3].abs().max() / 127).all()


def test_int8_write_kernel_equals_torch_twin():
    """Prefill chunks, decodes that raise a block's scale, and a block reused from offset 0: the same bytes."""
    ops = kernels.load()
    gen = torch.Generator().manual_seed(1)
    caches = [(torch.zeros(8, BLOCK, 2, 16, dtype=torch.int8), torch.zeros(8, 2)) for _ in range(2)]
    steps = [[20, 21, 22, 23, 24, 25], [26], [27], [12, 13], [14], [28, 29, 30, 31, 4, 5], [20, 21]]
    for i, slots in enumerate(steps):
        x = torch.randn(len(slots), 2, 16, generator=gen) * (1 + i)  # larger each step: scales grow
        ops.kv_cache_write_int8(*caches[0], torch.tensor(slots), x)
        _write_int8(*caches[1], torch.tensor(slots), x)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), i

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_kernel_equals_index_put(dtype):
    """k and v as a layer hands them over (views of one qkv matmul's output, strided), slots in any order."""
    ops = kernels.load()
    qkv = torch.randn(5, (4 + 2 * 2) * 16).to(dtype)                            # [T, (H + 2 KV) * D]
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)               # [T, KV, D], strided
    slots = torch.tensor([33, 2, 17, 16, 63])
    ours, twin = (KVCache.allocate(16, BLOCK, 2, 16, dtype) for _ in range(2))
    ours.write(slots, k, v)  # the kernel, or (the "torch" run) index_put itself
    twin.k.view(-1, 2, 16)[slots], twin.v.view(-1, 2, 16)[slots] = k, v
    assert torch.equal(ours.k, twin.k) and torch.equal(ours.v, twin.v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.kv_cache_write(ours.k, ours.v, torch.tensor([64]), k[:1], v[:1])
