"""One GPT-OSS MoE layer (gpt-oss-20b's shape by default: hidden 2880, 32 experts of width 2880, top 4) on the same
random MXFP4 weights three ways: its experts kept compact as a stage loads them (MXFP4 in Q5_0's layout, our
kernels), dequantized to fp32 nn.Linears (what loading them dense gives), and transformers' GptOssMLP on the
dequantized weights. Times per token count, the experts' bytes, and the largest difference from HF's output.

    python benchmarks/gpt_oss_moe.py [--threads 2] [--experts 32] [--json gpt_oss_moe.json]
"""
import argparse
import json

import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from pipellm.model_config import ModelConfig
from pipellm.models.layers import transpose_linears
from pipellm.models.moe import SparseMoE
from pipellm.pipeline.profile import best_of
from pipellm.quant import mxfp4
from pipellm.quant.linear import CompactLinear


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--width", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, w, e = args.hidden, args.width, args.experts
    packed = {}
    for proj, (rows, cols) in (("gate_up_proj", (2 * w, h)), ("down_proj", (h, w))):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(118, 122, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
        packed[proj] = (blocks, scales)
    hf = GptOssMLP(GptOssConfig(hidden_size=h, intermediate_size=w, num_local_experts=e, num_experts_per_tok=args.top_k))
    cfg = ModelConfig("GptOssForCausalLM", 1000, h, 1, 8, 8, 64, w, 4096, 1e-5, num_experts=e,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=w, swiglu_limit=7.0)
    dense, compact = SparseMoE(cfg).eval(), SparseMoE(cfg).eval()
    with torch.no_grad():
        torch.nn.init.normal_(hf.router.weight, std=0.02, generator=gen)
        torch.nn.init.normal_(hf.router.bias, std=0.02, generator=gen)
        for proj, (blocks, scales) in packed.items():
            getattr(hf.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            torch.nn.init.normal_(getattr(hf.experts, proj + "_bias"), std=0.02, generator=gen)
        # HF interleaves gate and up (gate 0, up 0, ...); ours has the gates' rows, then the ups', as the loader
        rows = {"gate_up_proj": torch.cat([torch.arange(0, 2 * w, 2), torch.arange(1, 2 * w, 2)]),
                "down_proj": torch.arange(h)}
        for moe in (dense, compact):
            moe.gate.weight.copy_(hf.router.weight)
            moe.gate.bias.copy_(hf.router.bias)
            for i, expert in enumerate(moe.experts):
                for proj in packed:
                    linear = getattr(expert, proj)
                    linear.weight.copy_(getattr(hf.experts, proj)[i].t()[rows[proj]])
                    linear.bias.copy_(getattr(hf.experts, proj + "_bias")[i][rows[proj]])
        for i, expert in enumerate(compact.experts):  # as the loader keeps them
            for proj, (blocks, scales) in packed.items():
                bias = getattr(expert, proj).bias.detach().float()
                weight = mxfp4.quant_weight(blocks[i][rows[proj]], scales[i][rows[proj]])
                setattr(expert, proj, CompactLinear([weight], bias))
    transpose_linears(dense)  # the layout a stage runs
    transpose_linears(compact)
    expert_bytes = {"compact": sum(p.nbytes for x in compact.experts for lin in (x.gate_up_proj, x.down_proj)
                                   for p in lin.parts),
                    "dense fp32": sum(p.numel() * 4 for x in dense.experts for lin in (x.gate_up_proj, x.down_proj)
                                      for p in lin.parameters() if p.dim() == 2)}
    print(f"experts' weights: compact {expert_bytes['compact'] / 1e6:.0f} MB, dense fp32 "
          f"{expert_bytes['dense fp32'] / 1e6:.0f} MB")
    rows = []
    with torch.inference_mode():
        for tokens in (1, 4, 16, 64, 256):
            x = torch.randn(tokens, h, generator=gen)
            ref = hf(x[None])[0][0]
            repeats = 10 if tokens <= 16 else 3
            times = {name: best_of(lambda: fn(x), repeats) for name, fn in
                     (("compact", compact), ("dense", dense), ("hf", lambda x: hf(x[None])))}
            diff = max((m(x) - ref).abs().max().item() for m in (compact, dense))
            rows.append({"tokens": tokens, **{f"{k}_ms": v * 1e3 for k, v in times.items()}, "max_diff": diff})
            print(f"{tokens:4d} tokens: compact {times['compact'] * 1e3:8.2f} ms, dense fp32 "
                  f"{times['dense'] * 1e3:8.2f} ms, HF {times['hf'] * 1e3:8.2f} ms; HF / compact "
                  f"{times['hf'] / times['compact']:5.2f}, dense / compact {times['dense'] / times['compact']:5.2f}; "
                  f"largest difference from HF {diff:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "expert_bytes": expert_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
