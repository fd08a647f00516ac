"""One layer's decode attention through our kernel (the default model's heads: 9 query, 3 KV, head_dim 64; fp32
cache, bf16 or int8, blocks of 16 in random order), by default at 8 x 4,096 tokens (50 MB of K/V, from memory) and 8 x 256
(in cache); --shapes 1x256,1x16384 for one sequence, 1x4096+15x256 for sequences of different lengths in one call.
To compare two builds of the kernels, run this once per build, alternating: `--kernels PATH` loads a built
pipellm_kernels .so (copy one aside before rebuilding); the default is this checkout's own build.

    python benchmarks/decode_attention.py [--kernels PATH] [--threads 2] [--huge-pages] [--int8 | --bf16]
        [--shapes 8x4096,8x256]
        [--softcap 50] [--sinks]

--sinks: GPT-OSS's attention sinks through the kernel, and beside it the plain-torch path that the sinks take
without it (the blocks gathered for SDPA's CPU kernel, its output scaled by its log-sum-exp).
"""
import argparse
import os
import time

import torch

from pipellm import kernels
from pipellm.models.attention import _attend
from pipellm.models.huge_pages import zeros_on_huge_pages

BLOCK, KV, HEADS, DIM = 16, 3, 9, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default=None, help="a built pipellm_kernels .so (default: this checkout's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--huge-pages", action="store_true", help="the caches on 2 MB pages, as a stage holds them")
    parser.add_argument("--int8", action="store_true", help="an int8 cache (kv_cache_dtype='int8', a scale per block)")
    parser.add_argument("--bf16", action="store_true", help="a bf16 cache (dtype='bfloat16' or kv_cache_dtype)")
    parser.add_argument("--shapes", default="8x4096,8x256", help="sequences x context, comma-separated; groups of "
                        "one call joined by +")
    parser.add_argument("--softcap", type=float, default=0.0, help="soft-capped scores (Gemma 2: 50)")
    parser.add_argument("--sinks", action="store_true", help="attention sinks (GPT-OSS), and the torch path's time")
    args = parser.parse_args()
    if args.kernels:  # before the first load: a process holds one build
        os.environ["PIPELLM_KERNELS"] = args.kernels
    ops = kernels.load()
    torch.set_num_threads(args.threads)
    out = []
    for spec in args.shapes.split(","):
        groups = [tuple(map(int, g.split("x"))) for g in spec.split("+")]
        contexts = [c for n, c in groups for _ in range(n)]
        seqs, context = len(contexts), max(contexts)
        gen = torch.Generator().manual_seed(0)
        width = -(-context // BLOCK)
        shape = (seqs * width, BLOCK, KV, DIM)
        k, v = ((zeros_on_huge_pages(shape, torch.float32) if args.huge_pages else torch.empty(shape))
                .normal_(generator=gen) for _ in range(2))
        scales = (None, None)
        if args.int8:
            k, v = ((x * 40).clamp(-127, 127).to(torch.int8) for x in (k, v))
            scales = tuple(torch.rand(shape[0], KV, generator=gen) / 40 for _ in range(2))
        elif args.bf16:
            k, v = k.bfloat16(), v.bfloat16()
        tables = torch.randperm(seqs * width, generator=gen).view(seqs, width)
        lens = torch.tensor(contexts)
        q = torch.randn(seqs, HEADS, DIM, generator=gen)
        sinks = torch.linspace(-1, 3, HEADS) if args.sinks else None

        def torch_path():  # as models/attention.py's plain-torch path: the blocks gathered and masked
            keys, values = (x[tables.reshape(-1)].view(seqs, width * BLOCK, KV, DIM).transpose(1, 2) for x in (k, v))
            mask = (torch.arange(width * BLOCK)[None, :] < lens[:, None])[:, None, None, :]
            return _attend(q[:, :, None], keys.float(), values.float(), mask, DIM ** -0.5, args.softcap or None,
                           sinks)

        def kernel():
            return ops.paged_decode_attention(q, k, v, *scales, tables, lens, 0, DIM ** -0.5, args.softcap, "", sinks)

        times, outs = {}, {}
        for name, fn in [("kernel", kernel)] + ([("torch", torch_path)] if args.sinks and not args.int8 else []):
            times[name] = []
            for _ in range(30 if sum(contexts) > 8000 else 200):
                start = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - start)
        o = outs["kernel"]
        quarter = sorted(times["kernel"])[len(times["kernel"]) // 4]  # the best quarter's edge: steadier than the min
        gb = 2 * k.nbytes / 1e9 * sum(contexts) / (seqs * width * BLOCK)  # the K/V read
        versus = ""
        if "torch" in times:
            torch_quarter = sorted(times["torch"])[len(times["torch"]) // 4]
            diff = (outs["torch"].view_as(o) - o).abs().max().item()
            versus = f", torch path {torch_quarter * 1e3:.3f} ms ({torch_quarter / quarter:.1f}x the kernel's; " \
                     f"outputs {diff:.1e} apart)"
        out.append(f"{spec}: {quarter * 1e3:.3f} ms, {gb / quarter:.1f} GB/s of K/V{versus} "
                   f"(output sum {o.double().sum().item():.6f})")
    print(" | ".join(out))


if __name__ == "__main__":
    main()
