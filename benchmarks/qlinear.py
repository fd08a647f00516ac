"""Our compact-weight matmul (ops.qlinear) against torch's fp32 matmul of the same weights, in one run.

    python benchmarks/qlinear.py [--kernels PATH] [--rows 1,4,16,64,256] [--isa avx2]
    python benchmarks/qlinear.py --rows 1 --isa avx2,avx512   # fused Q4 and Q8 per instruction set, in turns
    python benchmarks/qlinear.py --bf16-paths                 # bf16 rows: fp32 kernels, bf16 slices, AMX tiles
    python benchmarks/qlinear.py --rows 8,16 --isa amx,avx512 --k-quants   # Q4_K and Q6_K (groups of 16) too
Shapes of the default model (qkv+gate/up, down, LM head); 1 to 256 activation rows; the torch threads this
process has (2 here). 'fused' expands weight blocks in registers for all rows; 'chunked' expands ~2 MB of rows
to fp32 and calls torch's matmul (the path above FUSED_MAX_ROWS); 'int8' rounds the activation rows to 8 bits and
multiplies the codes in integers (EngineConfig.int8_activations uses that for one row only); 'bf16' takes bf16 rows
(dtype="bfloat16": above FUSED_MAX_ROWS, bf16 weight slices and torch's bf16 matmul), against the same weights
dense in bf16. With the amx instruction set (the default where the CPU has AMX tiles), 6 or more fp32 rows take
the tiles whatever 'fused' or 'chunked' asks: `--isa avx512` gives the paths without them.
To compare two builds, run this once per build, alternating: `--kernels PATH` loads a built pipellm_kernels .so
(copy one aside before rebuilding).
"""
import argparse
import os
import time

import torch

from pipellm.kernels import load
from pipellm.quant.linear import FUSED_MAX_ROWS, Q4, Q8


def bench(f, n: int = 50) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default=None, help="a built pipellm_kernels .so (default: this checkout's)")
    parser.add_argument("--rows", default="1,4,16,64,256", help="activation row counts, comma-separated")
    parser.add_argument("--isa", default="", help="an instruction set to run instead of this CPU's best; several "
                        "(comma-separated): the fused kernels of each, in turns, best of --rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--k-quants", action="store_true", help="with several --isa: also Q4_K and Q6_K blocks "
                        "(random codes, valid scales) at a Llama-like 3072 x 768 and 768 x 2048")
    parser.add_argument("--bf16-paths", action="store_true", help="bf16 rows through each path, in turns (AMX's "
                        "needs a CPU with AMX tiles)")
    args = parser.parse_args()
    if args.kernels:  # before the first load: a process holds one build
        os.environ["PIPELLM_KERNELS"] = args.kernels
    ops = load()
    if args.bf16_paths:
        rows = [int(r) for r in args.rows.split(",")] if args.rows != parser.get_default("rows") else [
            1, 2, 4, 8, 16, 32, 64, 200]
        return compare_bf16_paths(ops, rows, args.rounds)
    isa = args.isa
    if "," in isa:
        return compare_isas(ops, isa.split(","), [int(r) for r in args.rows.split(",")], args.rounds, args.k_quants)
    print(f"kernel path: {isa or ops.best_isa()}, {torch.get_num_threads()} threads; times in ms")
    torch.manual_seed(0)
    for n, k in [(3072, 576), (576, 1536), (49152, 576)]:
        q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale, mins = (torch.rand(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.01).half()
        wt = ops.dequant_rows(q4, scale, mins, Q4, 32, None, None, None, 0, torch.arange(n), "").t().contiguous()  # [K, N], as fp32 layers
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            fp32 = bench(lambda: x @ wt)
            q4_args, q8_args = (q4, scale, mins, Q4, 32, None, None, None, 0), (q8, scale, None, Q8, 32, None, None,
                                                                                 None, 0)
            fused = bench(lambda: ops.qlinear(x, *q4_args, 1 << 30, False, 0, isa))
            chunked = bench(lambda: ops.qlinear(x, *q4_args, 0, False, 0, isa))
            fused8 = bench(lambda: ops.qlinear(x, *q8_args, 1 << 30, False, 0, isa))
            int4 = bench(lambda: ops.qlinear(x, *q4_args, 1 << 30, True, 1 << 30, isa))
            int8 = bench(lambda: ops.qlinear(x, *q8_args, 1 << 30, True, 1 << 30, isa))
            xb, wtb = x.bfloat16(), wt.bfloat16()
            bf16 = bench(lambda: ops.qlinear(xb, *q4_args, FUSED_MAX_ROWS, False, 0, isa))
            dense_bf16 = bench(lambda: xb @ wtb)
            print(f"{n:6d} x {k:4d}, {m:3d} rows: fp32 {fp32:7.3f}  Q4 fused {fused:7.3f}  Q4 chunked {chunked:7.3f}  "
                  f"Q8 fused {fused8:7.3f}  Q4 int8 {int4:7.3f}  Q8 int8 {int8:7.3f}  Q4 bf16 {bf16:7.3f}  "
                  f"dense bf16 {dense_bf16:7.3f}")


def random_weights(n: int, k: int) -> dict:
    """qlinear's weight arguments for random Q4 (fp16 scale and min, as Q4_1) and Q8 (as Q8_0) codes [n, k]."""
    scale, mins = (torch.rand(n, k // 32) * 0.01).half(), (torch.randn(n, k // 32) * 0.01).half()
    return {"Q4": (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), scale, mins, Q4, 32, None, None, None, 0),
            "Q8": (torch.randint(-127, 128, (n, k), dtype=torch.int8), scale, None, Q8, 32, None, None, None, 0)}


def k_quant_weights(n: int, k: int) -> dict:
    """qlinear's weight arguments for Q4_K and Q6_K blocks [n, k] of random bytes with small fp16 super-scales."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from pipellm.quant.gguf_blocks import _BLOCK_BYTES, repack
    rng = np.random.default_rng(0)
    out = {}
    for qtype, scales_at in ((T.Q4_K, (0, 2)), (T.Q6_K, (208,))):
        blocks = rng.integers(0, 256, (n, k // 256, _BLOCK_BYTES[qtype]), dtype=np.uint8)
        for at in scales_at:
            blocks[..., at:at + 2] = (rng.random((n, k // 256, 1)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
        out[qtype.name] = repack(blocks.reshape(n, -1), qtype, n, k)._kernel_args()
    return out


def compare_bf16_paths(ops, rows: list[int], rounds: int) -> None:
    """bf16 rows (dtype="bfloat16") times Q4 (as Q4_1) and Q8 (as Q8_0) weights by each path, alternating within
    each round: the fp32 kernels (rows widened, the result rounded), weight slices expanded for torch's bf16 matmul,
    and AMX tiles (from ops.AMX_MIN_ROWS rows, where the CPU has them)."""
    amx = ops.best_isa() == "amx"
    print(f"{torch.get_num_threads()} threads; best of {rounds} rounds, us: fp32 kernels / bf16 slices"
          + (" / AMX tiles" if amx else " (no AMX tiles on this CPU)"))
    torch.manual_seed(0)
    for n, k in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        weights = random_weights(n, k)
        for name, w in weights.items():
            cells = []
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                paths = [("avx512" if amx else "", 1 << 30), ("avx512" if amx else "", 0)] + (
                    [("amx", 0)] if amx and m >= ops.AMX_MIN_ROWS else [])
                best = [float("inf")] * len(paths)
                for _ in range(rounds):
                    for i, (isa, fused_max_rows) in enumerate(paths):
                        best[i] = min(best[i], bench(lambda: ops.qlinear(x, *w, fused_max_rows, False, 0, isa), 5))
                cells.append(f"{m}: " + "/".join(f"{t * 1e3:.0f}" for t in best))
            print(f"{name} {n:5d} x {k:4d}  " + "  ".join(cells), flush=True)


def compare_isas(ops, isas: list[str], rows: list[int], rounds: int, k_quants: bool = False) -> None:
    """The fused Q4 (fp16 scale and min, as Q4_1) and Q8 (as Q8_0) kernels of each instruction set (and Q4_K and
    Q6_K), alternating within each round: the machine's drifting load hits them alike."""
    print(f"{torch.get_num_threads()} threads; best of {rounds} rounds, ms")
    torch.manual_seed(0)
    shapes = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
    for n, k in shapes + ([(3072, 768), (768, 2048)] if k_quants else []):
        weights = random_weights(n, k) if (n, k) in shapes else k_quant_weights(n, k)
        for m in rows:
            x = torch.randn(m, k)
            best = {}
            for _ in range(rounds):
                for kind, w in weights.items():
                    for isa in isas:
                        t = bench(lambda: ops.qlinear(x, *w, 1 << 30, False, 0, isa), 20 if n < 10_000 else 4)
                        best[kind, isa] = min(t, best.get((kind, isa), t))
            print(f"{n:6d} x {k:4d}, {m:3d} rows: " + "   ".join(
                kind + " " + " ".join(f"{isa} {best[kind, isa]:.4f}" for isa in isas)
                + f" ({best[kind, isas[0]] / best[kind, isas[-1]]:.2f}x)" for kind in weights))


if __name__ == "__main__":
    main()
