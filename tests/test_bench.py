"""`pipellm bench`: the figures it prints and saves are there and consistent."""
import json
import os
import subprocess
import sys

from safetensors import safe_open

from pipellm.entrypoints.bench import run_bench


def test_run_bench_reports_consistent_figures(llama_dir):
    r = run_bench(llama_dir, pipeline_parallel_size=2, num_prompts=6, input_len=(8, 24), output_len=5,
                  dtype="float32", use_tqdm=False, compare_hf=True)
    assert r["generated_tokens"] == 6 * 5
    assert 6 * 8 <= r["prompt_tokens"] <= 6 * 24
    assert r["generated_tok_s"] > 0 and r["total_tok_s"] > r["generated_tok_s"]
    for key in ("ttft_s", "itl_s"):
        p = r[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert len(r["stage_busy_pct"]) == 2 and all(0 < b <= 100 for b in r["stage_busy_pct"])
    assert 0 <= r["bubble_pct"] <= 100
    assert r["bytes_sent_per_token"][0] == 64 * 4  # hidden 64, fp32, no residual
    assert r["hf"]["generated_tok_s"] > 0 and r["ratio_vs_hf"] == r["generated_tok_s"] / r["hf"]["generated_tok_s"]
    # every tensor of the (untied, fp32) checkpoint is held by exactly one stage, at its size in the file, but the
    # embedding, which the first stage reads from the file as it looks rows up
    with safe_open(os.path.join(llama_dir, "model.safetensors"), "pt") as f:
        file_bytes = sum(f.get_tensor(n).nbytes for n in f.keys())
        embed_bytes = f.get_tensor("model.embed_tokens.weight").nbytes
    memory = r["stage_memory"]
    assert len(memory) == 2 and sum(m["weights"]["F32"] for m in memory) == file_bytes - embed_bytes
    assert memory[0]["weights"]["F32 file-mapped"] == embed_bytes and len(memory[1]["weights"]) == 1
    assert all(m["kv_cache"] > 0 and m["resident"] > m["weights"]["F32"] + m["kv_cache"] for m in memory)


def test_cli_bench_saves_json(tmp_path, llama_dir):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "pipellm.entrypoints.cli", "bench", "--model", llama_dir,
                           "--num-prompts", "4", "--input-len", "8-16", "--output-len", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "generated tok/s" in proc.stdout and "bubble" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["config"]["input_len"] == [8, 16] and saved["generated_tokens"] == 12
