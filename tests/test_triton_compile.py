"""A GPU stage's Triton kernels compiled for NVIDIA GPUs, here where none is: Triton's compiler and its own ptxas
make machine code of them for the T4 (sm_75), A100 (sm_80), H100 and H200 (sm_90a), B200 (sm_100a) and RTX 50
(sm_120a), at the shapes of models pipellm runs, with the parameters a stage would launch them with. Triton's
interpreter, which runs them in test_attention.py, checks neither that they compile nor that their tiles fit in
registers (ptxas spills none here).

Run as a script without TRITON_INTERPRET, it compiles the cases given as JSON (the test's), or this file's, and
prints each one's registers and spilled bytes.
    TRITON_CACHE_DIR=$(mktemp -d) .venv/bin/python tests/test_triton_compile.py"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton (the test extra, on Linux) is not installed: it compiles the GPU kernels")

# query heads, KV heads, head size: groups of 1 to 16 query heads a KV head, heads 64 to 256 wide
MODELS = {"SmolLM2-135M": (9, 3, 64), "Llama-3.1-8B": (32, 8, 128), "Llama-3.1-70B": (64, 8, 128),
          "Llama-3.1-405B": (128, 8, 128), "Gemma-2-9B": (16, 8, 256), "Gemma-3-1B": (4, 1, 256),
          "Phi-3-mini": (32, 32, 96), "GPT-2": (12, 12, 64), "GPT-OSS-20B": (64, 8, 64)}  # GPT-OSS: with sinks
CASES = [  # (model, cache dtype, block size, split, soft cap, compute capability)
    *[(m, "bf16", 16, split, m.startswith("Gemma-2"), 90) for m in MODELS for split in (False, True)],
    *[(m, dtype, 16, True, False, 90) for m in ("Llama-3.1-8B", "Gemma-2-9B", "Phi-3-mini")
      for dtype in ("fp32", "fp16", "i8")],
    *[(m, "bf16", 32, True, False, 90) for m in ("SmolLM2-135M", "Llama-3.1-70B", "Gemma-2-9B", "Phi-3-mini")],
    *[(m, "bf16", 16, True, False, arch) for m in ("SmolLM2-135M", "Llama-3.1-405B") for arch in (80, 100, 120)],
    *[("Llama-3.1-8B", dtype, 16, True, False, 75) for dtype in ("fp16", "i8")],  # a T4's: fp16, not bf16
]
MERGES = [(64, 4, 90, False), (128, 64, 90, False), (256, 16, 90, False), (128, 64, 80, False),
          (64, 16, 90, True)]  # (head size, splits, compute capability, sinks)


def _case_id(case) -> str:
    model, dtype, block, split, softcap, arch = case
    return f"{model}-{dtype}-block{block}{'-split' if split else ''}{'-softcap' if softcap else ''}-sm{arch}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every case, compiled in one process without Triton's interpreter, into a cache of its own (a cached kernel
    would skip ptxas, and its report)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, __file__, json.dumps({"decode": CASES, "merge": MERGES})], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_kernel_compiles_for_nvidia_gpus_without_spilling(compiled, case):
    result = compiled["decode"][_case_id(case)]
    assert result["error"] is None, result["error"]
    assert result["spilled"] == 0, result


@pytest.mark.parametrize("case", MERGES, ids=lambda c: f"head{c[0]}-splits{c[1]}-sm{c[2]}{'-sinks' if c[3] else ''}")
def test_merge_kernel_compiles_for_nvidia_gpus_without_spilling(compiled, case):
    result = compiled["merge"][f"{case}"]
    assert result["error"] is None, result["error"]
    assert result["spilled"] == 0, result


def _compile(fn, signature: dict, constants: dict, num_warps: int, arch: int) -> dict:
    """Registers and spilled bytes, from the report of the ptxas run Triton makes itself; or the error."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), knobs.nvidia.scope():
            knobs.nvidia.dump_ptxas_log = True
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    except Exception as e:  # noqa: BLE001 - reported per case
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    spilled = re.search(r"(\d+) bytes spill stores", log.getvalue())
    if not (registers and spilled):
        return {"error": f"no ptxas report: {log.getvalue()[-500:]}"}
    return {"error": None, "registers": int(registers.group(1)), "spilled": int(spilled.group(1))}


def _compile_all(decode_cases: list, merge_cases: list) -> dict:
    from pipellm.kernels import triton_decode

    results = {"decode": {}, "merge": {}}
    for case in decode_cases:
        model, dtype, block, split, softcap, arch = case
        heads, kv_heads, head_dim = MODELS[model]
        constants = triton_decode._config(heads, kv_heads, head_dim, block)
        num_warps = constants.pop("num_warps")
        constants.update(INT8=dtype == "i8", SOFTCAP=softcap, SPLIT=split, SINKS=model.startswith("GPT-OSS"))
        signature = {"q_ptr": "*fp32", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "ks_ptr": "*fp32",
                     "vs_ptr": "*fp32", "tables_ptr": "*i64", "lens_ptr": "*i64", "sinks_ptr": "*fp32",
                     "out_ptr": "*fp32",
                     "part_ptr": "*fp32", "stats_ptr": "*fp32", "table_width": "i32", "window": "i32",
                     "scale": "fp32", "softcap": "fp32", "blocks_per_split": "i32"}
        results["decode"][_case_id(case)] = _compile(triton_decode._decode, signature, constants, num_warps, arch)
    for head_dim, splits, arch, sinks in merge_cases:
        constants = dict(H=32, D=head_dim, D_P=head_dim, SPLITS_P=splits, SINKS=sinks)
        signature = {"part_ptr": "*fp32", "stats_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*fp32",
                     "num_splits": "i32"}
        results["merge"][f"{(head_dim, splits, arch, sinks)}"] = _compile(triton_decode._merge, signature, constants, 4,
                                                                  arch)
    return results


if __name__ == "__main__":  # with no argument: this file's cases, a line each
    given = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"decode": CASES, "merge": MERGES}
    results = _compile_all(given["decode"], given["merge"])
    if len(sys.argv) > 1:
        print(json.dumps(results))
    else:
        for name, r in {**results["decode"], **results["merge"]}.items():
            print(f"{name:52}", r["error"] or f"{r['registers']} registers, {r['spilled']} bytes spilled")
