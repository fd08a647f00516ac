"""The default model's fp32 linear layers read from memory, as a decode step of a dense fp32 stage reads them: 30
layers' distinct weights (q/k/v, o, gate/up, down) and the LM head, each product through our kernels
(ops.Linear.dense), the same rows through them all. Prints each row count's median time, and the weights' read
rate and the FLOP rate it reached; `--warm` also times one layer's weights 30 times over (in cache), the compute's
own rate, for comparison.
    python benchmarks/dense_layers.py [--rows 1,16,32,64] [--threads 2] [--warm]
To compare two builds, run this once per build, alternating, with PIPELLM_KERNELS=PATH (a built .so copied aside).
"""
import argparse
import statistics
import time

import torch

from pipellm import kernels

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # [in, out]: q/k/v, o, gate/up, down
LAYERS, HEAD = 30, (576, 49152)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.load()
    if ops is None:
        raise SystemExit("the kernels did not load: run `make .venv/.installed-core` first")
    layers = [[ops.Linear.dense(torch.randn(k, n), None) for k, n in SHAPES] for _ in range(LAYERS)]
    head = ops.Linear.dense(torch.randn(*HEAD), None)
    weights = LAYERS * sum(k * n for k, n in SHAPES) + HEAD[0] * HEAD[1]
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (576, 1536)}

        def cold():
            for layer in layers:
                for linear, (k, _) in zip(layer, SHAPES):
                    linear(x[k])
            head(x[576])

        def warm():  # the first layer's weights, over and over (the LM head's 113 MB cannot stay in cache)
            for _ in range(LAYERS):
                for linear, (k, _) in zip(layers[0], SHAPES):
                    linear(x[k])

        for name, f, flops in (("from memory", cold, 2 * rows * weights),
                               ("in cache", warm, 2 * rows * LAYERS * sum(k * n for k, n in SHAPES))):
            if name == "in cache" and not args.warm:
                continue
            f()
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                f()
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            read = f", weights read at {4 * weights / t / 1e9:.1f} GB/s" if f is cold else ""
            print(f"{rows:3d} rows, {args.threads} thread(s), {name}: {t * 1e3:7.1f} ms, {flops / t / 1e9:6.1f} "
                  f"GFLOP/s{read}", flush=True)


if __name__ == "__main__":
    main()
