"""`pipellm bench --roofline`: this machine's fp32 matmul rate and memory read bandwidth, measured in the same run,
and what share of each the workload's model FLOPs and bytes reached on each stage."""
import json
import subprocess
import sys
import time

from pipellm.model_config import ModelConfig
from pipellm.pipeline.partition import StageLayers


def measure_limits(threads: int, rows: int, inner: int, outer: int) -> dict:
    """In a process of its own (its threads must not share cores with a running engine): the best fp32 matmul rate
    of [rows, inner] x [inner, outer] and the best read bandwidth over 256 MiB, with `threads` threads."""
    job = json.dumps(dict(threads=threads, rows=rows, inner=inner, outer=outer))
    code = "import sys; from pipellm.observe.roofline import limits_worker; limits_worker(sys.stdin.read())"
    out = subprocess.run([sys.executable, "-c", code], input=job, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def limits_worker(job_json: str, rounds: int = 7) -> None:
    import torch
    job = json.loads(job_json)
    torch.set_num_threads(job["threads"])
    a, b = torch.randn(job["rows"], job["inner"]), torch.randn(job["inner"], job["outer"])
    big = torch.ones(64 << 20)  # 256 MiB: far past any cache
    best_mm = best_read = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        best_mm = min(best_mm, (time.perf_counter() - start) / 10)
        start = time.perf_counter()
        big.sum()
        best_read = min(best_read, time.perf_counter() - start)
    print(json.dumps({"threads": job["threads"], "shape": [job["rows"], job["inner"], job["outer"]],
                      "matmul_flop_s": 2 * job["rows"] * job["inner"] * job["outer"] / best_mm,
                      "read_bytes_s": big.nbytes / best_read}))


def _context_sum(cfg: ModelConfig, layer: int, seq_lens: list[tuple[int, int]]) -> int:
    """Keys attended over all tokens run, summed: a request of P prompt and G generated tokens runs P + G - 1
    tokens, the one at position p attending p + 1 keys (fewer in a sliding window)."""
    window = cfg.sliding_window if cfg.is_sliding(layer) else None
    chunk = cfg.attention_chunk if cfg.is_sliding(layer) else 0  # Llama 4's: the keys of the position's chunk
    total = 0
    for prompt, generated in seq_lens:
        n = prompt + generated - 1
        if chunk:
            total += sum(p % chunk + 1 for p in range(n))
        elif window is not None:
            total += sum(min(p + 1, window) for p in range(n))
        else:
            total += n * (n + 1) // 2
    return total


def analyze(limits: dict, cfg: ModelConfig, stages: list[StageLayers], seq_lens: list[tuple[int, int]],
            busy_s: list[float], steps: list[int], weight_bytes: list[int], dtype_bytes: int) -> dict:
    """Per stage: model FLOPs (2 per weight a token passes, plus attention's QK and PV) and bytes (its weights once
    a step, plus the K/V each decode token reads) over the time it was busy, as shares of the measured limits."""
    tokens = sum(p + g - 1 for p, g in seq_lens)
    sampled = sum(g for _, g in seq_lens)
    out = []
    for stage, busy, n_steps, w_bytes in zip(stages, busy_s, steps, weight_bytes):
        flops, kv_bytes = 0, 0
        for layer in range(stage.start, stage.end):
            flops += 2 * cfg.layer_weights(layer, picked=True) * tokens
            if cfg.has_kv_cache(layer):  # a layer with a state (or none) attends over no keys
                heads, width = cfg.cache_shape(layer)
                kv_token_bytes = (1 if cfg.is_mla else 2) * heads * width * dtype_bytes
                # MLA: attention over the latent, its up-projection absorbed
                qk_width = width if cfg.is_mla else cfg.attention_shape(layer)[1]
                keys = _context_sum(cfg, layer, seq_lens)
                flops += 4 * cfg.num_heads * qk_width * keys
                kv_bytes += (keys - _context_sum(cfg, layer, [(p, 1) for p, _ in seq_lens])) * kv_token_bytes
        if stage.is_last:
            flops += 2 * cfg.hidden_size * cfg.vocab_size * sampled
        moved = n_steps * w_bytes + kv_bytes
        out.append({"stage": stage.rank, "flop_s": flops / busy, "bytes_s": moved / busy,
                    "matmul_share": flops / busy / limits["matmul_flop_s"],
                    "bandwidth_share": moved / busy / limits["read_bytes_s"]})
    return {"limits": limits, "stages": out}


def format_roofline(r: dict) -> list[str]:
    lim = r["limits"]
    rows, inner, outer = lim["shape"]
    lines = [f"roofline           this machine, {lim['threads']} thread(s): fp32 matmul {lim['matmul_flop_s'] / 1e9:.1f} "
             f"GFLOP/s ([{rows}x{inner}] x [{inner}x{outer}]), memory read {lim['read_bytes_s'] / 1e9:.1f} GB/s"]
    for s in r["stages"]:
        lines.append(f"  stage {s['stage']} (busy)   {s['flop_s'] / 1e9:.1f} GFLOP/s = {100 * s['matmul_share']:.0f}% of "
                     f"matmul, {s['bytes_s'] / 1e9:.2f} GB/s = {100 * s['bandwidth_share']:.0f}% of bandwidth")
    return lines
