"""One DeepSeek attention layer's decode step (DeepSeek-V2-Lite's shape by default: hidden 2048, 16 heads, a 512-wide
latent, 128 + 64 q.k dims, 128 v dims) over the same cached latents two ways: pipellm's MLA, attention on the latent
cache with each head's up-projection folded into its query and output, and transformers' DeepseekV2Attention, which
caches the same latents and expands every cached one into each head's keys and values at each step. Times a step
per context length, the largest difference between the two outputs, and the cache's bytes a token and layer (against
each head's keys and values, what an engine without MLA holds).

    python benchmarks/mla_decode.py [--threads 2] [--batch 4] [--contexts 512,2048,8192] [--json mla_decode.json]
"""
import argparse
import json
import os
import tempfile

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache

from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from pipellm.pipeline.profile import best_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_cfg = DeepseekV2Config(vocab_size=256, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
                              num_attention_heads=args.heads, num_key_value_heads=args.heads, kv_lora_rank=512,
                              q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                              max_position_embeddings=16384, first_k_dense_replace=1)
    hf = DeepseekV2ForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        cfg = ModelConfig.from_pretrained(folder)
        stage = build_stage_model(cfg, StageLayers(0, 0, 1, True, True), meta=True)
        load_stage_weights(stage, folder, torch.float32)
    ours, theirs = stage.layers[0].self_attn, hf.model.layers[0].self_attn
    rank, rope, bs, b = cfg.kv_lora_rank, cfg.qk_rope_head_dim, 16, args.batch
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])  # HF's rotary pairs -> ours
    rows = []
    for context in map(int, args.contexts.split(",")):
        latents, k_pe = torch.randn(b, context, rank), torch.randn(b, context, rope)
        blocks = -(-(context + 1) // bs)
        cache = KVCache.allocate(b * blocks, bs, 1, rank + rope, torch.float32, shared=True)
        tables = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
        flat = cache.k.view(b, blocks * bs, rank + rope)                                 # [B, slots, 576]
        flat[:, :context] = torch.cat([latents, k_pe[..., pairs]], -1)
        positions = torch.full((b,), context)
        slots = tables[:, context // bs].long() * bs + context % bs
        meta = AttentionMetadata.build(positions, torch.ones(b, dtype=torch.long), torch.full((b,), context + 1),
                                       tables, slots, bs)
        x = torch.randn(b, cfg.hidden_size)
        rope_tables = stage.rotary.tables(positions, torch.float32)
        hf_cache = DynamicCache(config=hf_cfg)
        with torch.no_grad():
            hf_cache.update(latents[:, None], k_pe[:, None], 0)
            cos_sin = hf.model.rotary_emb(x[:, None], positions[:, None])
            mask = torch.zeros(b, 1, 1, context + 1)

            def ours_step():
                return ours(x, (rope_tables, rope_tables), meta, cache)

            def theirs_step():
                out = theirs(x[:, None], attention_mask=mask, cache=hf_cache, position_embeddings=cos_sin)[0][:, 0]
                hf_cache.crop(-1)  # the step's own latent dropped, for the next run
                return out
            diff = (ours_step() - theirs_step()).abs().max().item()
            ours_s, theirs_s = best_of(ours_step, 3), best_of(theirs_step, 3)
        rows.append({"context": context, "batch": b, "pipellm_ms": ours_s * 1e3, "hf_ms": theirs_s * 1e3,
                     "speedup": theirs_s / ours_s, "max_abs_diff": diff})
        print(json.dumps(rows[-1]))
    per_head = cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)  # each head's K (q.k dims) and V, fp32 words
    result = {"threads": args.threads, "heads": cfg.num_heads, "cache_bytes_per_token_layer": (rank + rope) * 4,
              "per_head_kv_bytes_per_token_layer": per_head * 4, "steps": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
