"""Paged attention of every kind of step against a dense reference computed from each sequence's full K/V: ragged
lengths, shuffled block tables, cached prefixes, mixed steps, sliding windows, grouped-query heads."""
import math

import pytest
import torch

from pipellm import kernels
from pipellm.models.attention import AttentionMetadata, paged_attention

BLOCK = 4


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decode rows through our C++ kernel (K/V read in place), and through the plain-torch twin."""
    if request.param == "torch":
        monkeypatch.setattr("pipellm.models.attention.kernels", type("NoKernels", (), {"load": staticmethod(
            lambda: None)}))
    else:
        assert kernels.load() is not None


def _dense(q, keys, values, q_pos, window):
    """q [q, H, D] at positions q_pos; keys/values [S, KV, D] for positions 0..S-1. Softmax over allowed keys."""
    heads, kv = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv, dim=1)           # [S, H, D]
    values = values.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) / math.sqrt(q.shape[-1])
    key_pos = torch.arange(len(keys))
    allowed = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).float()


def _run(steps: list[tuple[int, int]], heads: int, kv_heads: int, window: int | None, seed: int):
    """steps: (cached tokens, new tokens) per sequence. Returns paged and dense outputs of the step."""
    gen = torch.Generator().manual_seed(seed)
    dim, num_blocks = 8, 64
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, dim)
    v_cache = torch.zeros(num_blocks, BLOCK, kv_heads, dim)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()   # block 0 stays unused padding
    width = max(-(-(c + n) // BLOCK) for c, n in steps)
    tables = torch.zeros(len(steps), width, dtype=torch.int32)
    full_k, full_v, positions, slots, qs = [], [], [], [], []
    for i, (cached, new) in enumerate(steps):
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        keys = torch.randn(total, kv_heads, dim, generator=gen)
        values = torch.randn(total, kv_heads, dim, generator=gen)
        for p in range(cached):  # the cached prefix is in the cache already
            k_cache[blocks[p // BLOCK], p % BLOCK] = keys[p]
            v_cache[blocks[p // BLOCK], p % BLOCK] = values[p]
        full_k.append(keys)
        full_v.append(values)
        positions += list(range(cached, total))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        qs.append(torch.randn(new, heads, dim, generator=gen))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, steps)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, steps)])
    q = torch.cat(qs)
    meta = AttentionMetadata.build(torch.tensor(positions), torch.tensor([n for _, n in steps]),
                                   torch.tensor([c + n for c, n in steps]), tables, torch.tensor(slots), BLOCK, window)
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, dim ** -0.5)
    dense = torch.cat([_dense(qi, k, v, torch.arange(c, c + n), window)
                       for qi, k, v, (c, n) in zip(qs, full_k, full_v, steps)])
    return out, dense


STEPS = {
    "decode, equal lengths": [(11, 1), (11, 1), (11, 1)],
    "decode, ragged": [(3, 1), (17, 1), (0, 1), (8, 1)],
    "prefill, whole prompts": [(0, 7), (0, 1 + BLOCK * 3), (0, 2)],
    "chunks after cached prefixes": [(5, 6), (BLOCK * 2, 3), (13, 9)],
    "mixed": [(9, 1), (0, 10), (4, 1), (6, 5), (21, 1)],
    "one long chunk and decodes": [(0, 40), (30, 1), (2, 1)],
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_equals_dense_reference(name, heads, kv_heads, window):
    out, dense = _run(STEPS[name], heads, kv_heads, window, seed=len(name))
    assert out.shape == dense.shape
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
