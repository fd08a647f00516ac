"""One Qwen3-Next linear-attention layer (Qwen3-Next-80B's shape: hidden 2048, 16 key heads and 32 value heads of
128, a 4-wide convolution), with --mixer mamba2 one Granite 4.0-H Mamba-2 layer (Granite-4.0-H-Small's shape:
hidden 4096, 128 heads of 64, one group, a 128-wide state), or with --mixer mamba1 one Jamba Mamba layer (Jamba
Mini's shape: hidden 4096, width 8192, a 16-wide state, dt rank 256), two ways on the same weights and states:
pipellm's GatedDeltaNet (Mamba2Mixer, Mamba1Mixer) and transformers' Qwen3NextGatedDeltaNet
(GraniteMoeHybridMambaLayer, JambaMambaMixer) with its cache (its torch fallbacks: no flash-linear-attention or
mamba-ssm kernels on a CPU).
Times a prompt of each length (one sequence, from an empty state) and a decode step of a batch (each sequence's state
after its prompt), and gives the largest difference between the two outputs. A decode step's cost does not grow with
the context: the state is the same size at any length.

    python benchmarks/linear_attention.py [--mixer delta|mamba2|mamba1] [--threads 2] [--batch 4] [--prompts 64,512,2048]
        [--json linear.json]
"""
import argparse
import json
import tempfile

import torch
from transformers import (DynamicCache, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig,
                          JambaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM)

from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.linear_attention import LinearState
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from pipellm.pipeline.profile import best_of


def meta_of(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """Metadata as a stage builds it (the layer reads only the lengths; no KV blocks)."""
    q, s = torch.tensor(query_lens), torch.tensor(seq_lens)
    positions = torch.cat([torch.arange(b - a, b) for a, b in zip(query_lens, seq_lens)])
    blocks = -(-max(seq_lens) // 16)
    tables = torch.zeros(len(q), blocks, dtype=torch.int32)
    return AttentionMetadata.build(positions, q, s, tables, positions, 16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mixer", choices=["delta", "mamba2", "mamba1"], default="delta")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", default="64,512,2048")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.mixer == "delta":
        hf_cfg = Qwen3NextConfig(vocab_size=256, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
                                 num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64, linear_num_key_heads=16,
                                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                                 linear_conv_kernel_dim=4)
        hf = Qwen3NextForCausalLM(hf_cfg).eval()
    elif args.mixer == "mamba1":
        hf_cfg = JambaConfig(vocab_size=256, hidden_size=4096, intermediate_size=64, num_hidden_layers=1,
                             num_experts=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256)
        hf = JambaForCausalLM(hf_cfg).eval()
    else:
        hf_cfg = GraniteMoeHybridConfig(vocab_size=256, hidden_size=4096, intermediate_size=64, num_hidden_layers=1,
                                        num_local_experts=0, shared_intermediate_size=64, layer_types=["mamba"],
                                        mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                                        mamba_d_conv=4, mamba_expand=2)
        hf = GraniteMoeHybridForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        cfg = ModelConfig.from_pretrained(folder)
        stage = build_stage_model(cfg, StageLayers(0, 0, 1, True, True), meta=True)
        load_stage_weights(stage, folder, torch.float32)
    mixer = "linear_attn" if args.mixer == "delta" else "mamba"
    ours, theirs = getattr(stage.layers[0], mixer), getattr(hf.model.layers[0], mixer)
    rows = []
    with torch.inference_mode():
        for length in map(int, args.prompts.split(",")):
            x = torch.randn(length, cfg.hidden_size)
            meta = meta_of([length], [length])
            state = LinearState.allocate(cfg, torch.float32)
            ours_s = best_of(lambda: ours(x, meta, state), 2)
            theirs_s = best_of(lambda: theirs(x[None], cache=DynamicCache(config=hf_cfg)), 2)
            diff = (ours(x, meta, state) - theirs(x[None], cache=DynamicCache(config=hf_cfg))[0]).abs().max().item()
            rows.append(dict(kind="prompt", tokens=length, ours_ms=ours_s * 1e3, transformers_ms=theirs_s * 1e3,
                             max_abs_diff=diff))
        # a decode step of args.batch sequences, each after a 64-token prompt
        b, prompt = args.batch, torch.randn(args.batch, 64, cfg.hidden_size)
        state, cache = LinearState.allocate(cfg, torch.float32), DynamicCache(config=hf_cfg)
        ours(prompt.reshape(-1, cfg.hidden_size), meta_of([64] * b, [64] * b), state)
        theirs(prompt, cache=cache)
        x, meta = torch.randn(b, cfg.hidden_size), meta_of([1] * b, [65] * b)
        saved = (state.conv.clone(), state.ssm.clone())

        def ours_step():  # each timed step from the same states
            state.conv.copy_(saved[0]), state.ssm.copy_(saved[1])
            return ours(x, meta, state)
        hf_saved = [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for layer in cache.layers]

        def theirs_step():
            for layer, (conv, rec) in zip(cache.layers, hf_saved):
                layer.conv_states[0].copy_(conv), layer.recurrent_states[0].copy_(rec)
            return theirs(x[:, None], cache=cache)
        diff = (ours_step() - theirs_step()[:, 0]).abs().max().item()
        rows.append(dict(kind="decode", tokens=b, ours_ms=best_of(ours_step, 10) * 1e3,
                         transformers_ms=best_of(theirs_step, 10) * 1e3, max_abs_diff=diff))
    print(f"{'step':>8} {'tokens':>7} {'pipellm ms':>11} {'transformers ms':>16} {'ratio':>6} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['kind']:>8} {r['tokens']:>7} {r['ours_ms']:>11.2f} {r['transformers_ms']:>16.2f} "
              f"{r['transformers_ms'] / r['ours_ms']:>5.2f}x {r['max_abs_diff']:>11.1e}")
    state_mib = LinearState.allocate(cfg, torch.bfloat16, rows=1).nbytes / 2 ** 20
    print(f"state: {state_mib:.2f} MiB a sequence and layer (bf16 convolution inputs, fp32 matrices), at any length")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, state_mib=state_mib, threads=args.threads), f, indent=1)


if __name__ == "__main__":
    main()
