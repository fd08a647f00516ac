"""An MoE layer's time against a dense MLP of the same active size (top-k experts of width I vs one MLP of width
k * I), for decode-sized and prefill-sized token counts, fp32 weights as a stage holds them. Prints a table and
writes moe_layer.json.

    python benchmarks/moe_layer.py [--threads 1]
"""
import argparse
import json

import torch

from pipellm.model_config import ModelConfig
from pipellm.models.layers import GatedMLP, transpose_linears
from pipellm.models.moe import SparseMoE
from pipellm.pipeline.profile import best_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-width", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig("MixtralForCausalLM", 1000, args.hidden, 1, 8, 8, args.hidden // 8, args.expert_width, 4096,
                      1e-5, num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.expert_width)
    moe = SparseMoE(cfg).eval()
    dense = GatedMLP(args.hidden, args.top_k * args.expert_width).eval()
    transpose_linears(moe)  # the layout a stage runs
    transpose_linears(dense)
    rows = []
    with torch.inference_mode():
        for tokens in (1, 4, 16, 64, 256, 512):
            x = torch.randn(tokens, args.hidden)
            repeats = 20 if tokens <= 64 else 5
            t_moe, t_dense = best_of(lambda: moe(x), repeats), best_of(lambda: dense(x), repeats)
            rows.append({"tokens": tokens, "moe_ms": t_moe * 1e3, "dense_ms": t_dense * 1e3, "ratio": t_moe / t_dense})
            print(f"{tokens:4d} tokens: MoE {t_moe * 1e3:8.3f} ms, dense {t_dense * 1e3:8.3f} ms, "
                  f"MoE / dense {t_moe / t_dense:5.2f}")
    with open("moe_layer.json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
