"""Perplexity of the default model on tests/data/perplexity.txt (an original ~1,900-token story written for this
project and dedicated to the public domain, CC0), through each weight path, in this process (PP=1, one prefill).

    python benchmarks/perplexity.py [--json out.json]
Paths: compact (the GGUF's own formats through our kernels), fp32 (the same weights dequantized, plain torch),
and fp32 re-quantized on load with quantization="int8" / "int4"; then compact weights with kv_cache_dtype="bfloat16"
and "int8" (the prefill's attention reads the rounded keys and values back from the cache), and with
int8_activations (every matmul's activation rows rounded to 8 bits per 32).
"""
import argparse
import json
import math
import os
import tempfile
import time

import torch

from pipellm.loader.model_folder import load_tokenizer
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import cached_gguf_folder, convert_gguf, load_gguf_stage_weights
from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from pipellm.quant.linear import set_int8_activations
from pipellm.quant.rtn import quantize_linears

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "perplexity.txt")
BLOCK = 16


def build(folder: str, cfg: ModelConfig, path: str):
    whole = StageLayers(0, 0, cfg.num_layers, True, True)
    if path == "compact":
        model = build_stage_model(cfg, whole, meta=True)
        load_gguf_stage_weights(model, folder, torch.float32)
    else:
        model = build_stage_model(cfg, whole)
        load_stage_weights(model, folder, torch.float32)
        if path != "fp32":
            quantize_linears(model, path)
    transpose_linears(model)
    return model.eval()


@torch.inference_mode()
def perplexity(model, cfg: ModelConfig, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> float:
    n = len(ids)
    blocks = -(-n // BLOCK)
    caches = [KVCache.allocate(blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
              for _ in range(cfg.num_layers)]
    positions = torch.arange(n)
    meta = AttentionMetadata.build(positions, torch.tensor([n]), torch.tensor([n]), torch.arange(blocks)[None],
                                   positions, BLOCK)
    hidden = model(torch.tensor(ids), positions, meta, caches)
    logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]).double(), dim=-1)  # [n - 1, vocab]
    nll = -logprobs[torch.arange(n - 1), torch.tensor(ids[1:])].mean().item()
    return math.exp(nll)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    compact_dir = cached_gguf_folder(default_model_path())
    tmp = tempfile.TemporaryDirectory()  # ~0.5 GB of fp32 weights, removed when main() returns
    fp32_dir = os.path.join(tmp.name, "fp32")
    convert_gguf(default_model_path(), fp32_dir)
    cfg = ModelConfig.from_pretrained(compact_dir)
    ids = load_tokenizer(compact_dir)(open(TEXT).read()).input_ids
    results = {}
    for path in ("compact", "fp32", "int8", "int4"):
        start = time.perf_counter()
        model = build(compact_dir if path == "compact" else fp32_dir, cfg, path)
        results[path] = perplexity(model, cfg, ids)
        print(f"{path:8s} perplexity {results[path]:.4f}  ({results[path] / results['compact']:.4f}x compact; "
              f"{time.perf_counter() - start:.1f} s)", flush=True)
        del model
    model = build(compact_dir, cfg, "compact")
    for name, kv_dtype in (("kv bfloat16", torch.bfloat16), ("kv int8", torch.int8)):
        results[name] = perplexity(model, cfg, ids, kv_dtype)
        print(f"{name:8s} perplexity {results[name]:.4f}  ({results[name] / results['compact']:.4f}x compact)",
              flush=True)
    set_int8_activations(model, True)
    results["int8 activations"] = perplexity(model, cfg, ids)
    print(f"int8 activations perplexity {results['int8 activations']:.4f}  "
          f"({results['int8 activations'] / results['compact']:.4f}x compact)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tokens=len(ids), perplexity=results), f, indent=2)


if __name__ == "__main__":
    main()
