"""Offline throughput: `pipellm bench`, or run_bench() from Python."""
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time

from pipellm.llm import LLM
from pipellm.observe.trace import collect, write_trace_dir
from pipellm.pipeline import wire
from pipellm.sampling_params import SamplingParams


def make_prompts(num_prompts: int, input_len: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token prompts with lengths uniform in [min, max], as vLLM's random dataset."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def run_bench(model: str | None = None, pipeline_parallel_size: int = 1, num_prompts: int = 32,
              input_len: tuple[int, int] = (64, 192), output_len: int = 64, dtype: str = "auto",
              threads_per_stage: int | None = None, compare_hf: bool = False, seed: int = 0,
              use_tqdm: bool = True, trace_dir: str | None = None, roofline: bool = False, **engine_kwargs) -> dict:
    if engine_kwargs.get("layer_partition") == "auto":  # balance for this workload's prompt/output mix
        engine_kwargs.setdefault("auto_partition_prompt_ratio", sum(input_len) / 2 / output_len)
    with LLM(model, pipeline_parallel_size=pipeline_parallel_size, dtype=dtype, threads_per_stage=threads_per_stage,
             seed=seed, trace=trace_dir is not None, **engine_kwargs) as llm:
        engine = llm.engine
        dtype = engine.config.dtype  # "auto" resolved
        prompts = make_prompts(num_prompts, input_len, engine.model_config.vocab_size, seed)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        if engine.device == "cpu":
            warm, warm_params = [p[:16] for p in prompts[:2]], SamplingParams(max_tokens=4)
        else:  # a GPU meets each shape's first costs once (cuDNN's plans, kernels loaded on first use), as HF's
            # warm-up does: the workload's shapes, other tokens (the prefix cache would skip the same prompts)
            vocab = engine.model_config.vocab_size
            warm, warm_params = [[(t + 1) % vocab for t in p] for p in prompts], params
        llm.generate([{"prompt_token_ids": p} for p in warm], warm_params, use_tqdm=False)
        if trace_dir is not None:
            collect(engine)  # drop the warm-up's events
        before = engine.inspect()
        busiest = _capture_busiest_decode_step(engine.executor)
        start = time.monotonic()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)
        elapsed = time.monotonic() - start
        del engine.executor.submit, engine.executor.receive  # the capture's wrappers
        trace_data = collect(engine) if trace_dir is not None else None  # before inspect(), which drains events
        after = engine.inspect()
        stages = [s.describe() for s in engine.stages]
        num_scheduler_steps, device = engine.config.num_scheduler_steps, engine.device
        async_scheduling = engine.config.is_async_scheduling
        partition_note = engine.partition_note
        layers, model_config, dtype_bytes = engine.stages, engine.model_config, engine.config.torch_dtype.itemsize
    trace_summary = write_trace_dir(trace_data, trace_dir) if trace_data is not None else None
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    itl = [b - a for o in outputs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:])]
    busy = [(a.busy_s - b.busy_s) / elapsed for a, b in zip(after, before)]
    bytes_sent = [a.activation_bytes_sent - b.activation_bytes_sent for a, b in zip(after, before)]
    tokens_sent = [a.activation_tokens_sent - b.activation_tokens_sent for a, b in zip(after, before)]
    result = {
        "config": dict(model=model, pipeline_parallel_size=pipeline_parallel_size, num_prompts=num_prompts,
                       input_len=list(input_len), output_len=output_len, dtype=dtype,
                       threads_per_stage=after[0].num_threads, seed=seed, stages=stages,
                       partition_note=partition_note, num_scheduler_steps=num_scheduler_steps, device=device,
                       async_scheduling=async_scheduling),
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "generated_tok_s": generated / elapsed,
        "total_tok_s": (generated + prompt_tokens) / elapsed,
        "requests_s": len(outputs) / elapsed,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "stage_busy_pct": [100 * b for b in busy],
        # Time the stages sat idle while requests were still unfinished (all of the run, offline).
        "bubble_pct": 100 * (1 - statistics.mean(busy)),
        "bytes_sent_per_token": [b / t if t else 0.0 for b, t in zip(bytes_sent, tokens_sent)],
        "stage_memory": [dict(weights=dict(r.weight_bytes), kv_cache=r.kv_cache_bytes, resident=r.rss_bytes)
                         for r in after],
    }
    if busiest["parts"]:
        result["messages_per_decode_step"] = time_codecs(busiest["parts"] + [busiest["sampled"]])
    if trace_summary is not None:
        result["trace"] = dict(dir=trace_dir, bubble_pct=trace_summary["bubble_pct"], balance=trace_summary["balance"])
    if roofline:  # measured now that the engine is gone: the same threads, on idle cores
        from pipellm.observe import roofline as rl
        limits = rl.measure_limits(after[0].num_threads, 256, model_config.hidden_size, model_config.intermediate_size)
        result["roofline"] = rl.analyze(
            limits, model_config, layers, [(len(p), len(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs)],
            [a.busy_s - b.busy_s for a, b in zip(after, before)], [a.steps - b.steps for a, b in zip(after, before)],
            [sum(n for _, n in r.weight_bytes) for r in after], dtype_bytes)
    if compare_hf:
        threads = after[0].num_threads * pipeline_parallel_size
        result["hf"] = run_hf(model, prompts, output_len, dtype, threads, device)
        result["ratio_vs_hf"] = result["generated_tok_s"] / result["hf"]["generated_tok_s"]
    return result


def _capture_busiest_decode_step(executor) -> dict:
    """Keeps the messages of the decode step with the most sequences (each stage's batch, and the tokens back)."""
    busiest = {"parts": [], "sampled": None, "num_seqs": 0}
    submit, receive = executor.submit, executor.receive

    def capturing_submit(batch):
        if (batch.query_lens == 1).all() and len(batch.query_lens) > busiest["num_seqs"]:
            busiest.update(parts=executor.parts(batch), num_seqs=len(batch.query_lens), batch_id=batch.batch_id)
        submit(batch)

    def capturing_receive():
        result = receive()
        if result.batch_id == busiest.get("batch_id"):
            busiest["sampled"] = result
        return result

    executor.submit, executor.receive = capturing_submit, capturing_receive
    return busiest


def time_codecs(messages: list, rounds: int = 7, reps: int = 200) -> dict:
    """Encode + decode of one step's messages, in the wire format (signed and checked) and with pickle, as before:
    the best of `rounds` alternating rounds, in microseconds per step."""
    key, context = wire.new_token().encode(), b"bench"

    def by_wire():
        for m in messages:
            frame = bytearray(wire.seal(key, context, wire.encode(m)))  # as received: a bytearray
            wire.decode(wire.unseal(key, context, frame, "bench"), (type(m),))

    def by_pickle():
        for m in messages:
            pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))

    best = {"wire": float("inf"), "pickle": float("inf")}
    for _ in range(rounds):
        for name, fn in (("wire", by_wire), ("pickle", by_pickle)):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps * 1e6)
    num_seqs = len(messages[0].query_lens)
    return {"num_seqs": num_seqs, "wire_us": best["wire"], "pickle_us": best["pickle"],
            "wire_bytes": sum(len(wire.encode(m)) + wire.TAG_BYTES for m in messages),
            "pickle_bytes": sum(len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) for m in messages)}


def run_hf(model: str | None, prompts: list[list[int]], output_len: int, dtype: str, threads: int,
           device: str = "cpu") -> dict:
    """HF transformers generate on the same requests, as one padded batch, in a process of its own
    (its OpenMP threads must not share a process, or cores, with a running engine), on device."""
    from pipellm.loader.model_folder import resolve_model
    from pipellm.loader.gguf import convert_gguf, gguf_source

    folder = resolve_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        if (source := gguf_source(folder)) is not None:  # transformers reads safetensors: the weights as fp32
            folder = os.path.join(tmp, "fp32")
            convert_gguf(source, folder)
        job = json.dumps(dict(model_dir=folder, prompts=prompts, output_len=output_len, dtype=dtype, threads=threads,
                              device=device))
        code = "import sys; from pipellm.entrypoints.bench import hf_worker; hf_worker(sys.stdin.read())"
        out = subprocess.run([sys.executable, "-c", code], input=job, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"HF transformers failed on {model or 'the default model'}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def hf_worker(job_json: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(job_json)
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    device = torch.device(job["device"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype).eval().to(device)
    prompts, n = job["prompts"], job["output_len"]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # warm-up; on a GPU at the timed run's own shapes, which cuDNN's attention plans on first sight: HF's best case
    warm = (ids, mask, n) if device.type == "cuda" else (ids[:2, -8:], mask[:2, -8:], 2)
    with torch.inference_mode():
        model.generate(warm[0], attention_mask=warm[1], max_new_tokens=warm[2], do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    print(json.dumps({"elapsed_s": elapsed, "generated_tok_s": generated / elapsed, "threads": job["threads"]}))


def format_result(r: dict) -> str:
    cfg = r["config"]
    lines = [
        f"pipellm bench: {cfg['num_prompts']} requests, prompt {cfg['input_len'][0]}-{cfg['input_len'][1]} tokens, "
        f"{cfg['output_len']} new tokens, pp={cfg['pipeline_parallel_size']}, {cfg['threads_per_stage']} "
        f"thread(s)/stage, {cfg['dtype']}"
        + (f", {cfg['num_scheduler_steps']} decode steps a batch" if cfg.get("num_scheduler_steps", 1) > 1 else "")
        + (", async scheduling" if cfg.get("async_scheduling") else ""),
        *[f"  {s}" for s in cfg["stages"]],
        *([f"  {cfg['partition_note']}"] if cfg.get("partition_note") else []),
        f"elapsed            {r['elapsed_s']:.2f} s",
        f"generated tok/s    {r['generated_tok_s']:.1f}",
        f"total tok/s        {r['total_tok_s']:.1f}",
        "TTFT  p50/p90/p99  " + " / ".join(f"{r['ttft_s'][k] * 1e3:.0f}" for k in ("p50", "p90", "p99")) + " ms",
        "ITL   p50/p90/p99  " + " / ".join(f"{r['itl_s'][k] * 1e3:.1f}" for k in ("p50", "p90", "p99")) + " ms",
        "stage busy         " + ", ".join(f"{b:.0f}%" for b in r["stage_busy_pct"]),
        f"bubble             {r['bubble_pct']:.1f}%",
        "bytes sent / token " + ", ".join(f"{b:.0f}" for b in r["bytes_sent_per_token"][:-1]),
        "memory per stage   " + "; ".join(
            f"{sum(m['weights'].values()) / 1e6:.0f} MB weights ({', '.join(m['weights'])}) + "
            f"{m['kv_cache'] / 1e6:.0f} MB KV, {m['resident'] / 1e6:.0f} MB resident" for m in r["stage_memory"]),
    ]
    if "messages_per_decode_step" in r:
        m = r["messages_per_decode_step"]
        lines.append(f"messages / step    {m['wire_us']:.0f} us signed wire format vs {m['pickle_us']:.0f} us pickle "
                     f"(encode + decode, decode step of {m['num_seqs']} sequences)")
    if "roofline" in r:
        from pipellm.observe.roofline import format_roofline
        lines += format_roofline(r["roofline"])
    if "hf" in r:
        lines.append(f"HF generate        {r['hf']['generated_tok_s']:.1f} generated tok/s "
                     f"({r['hf']['threads']} threads); pipellm / HF = {r['ratio_vs_hf']:.2f}x")
    return "\n".join(lines)
