"""The compact-weights issue's memory target for the whole pipeline: the default model at PP=2, 64 MiB of KV cache a
stage, against 2 x (an idle torch process) + 1.15 x the GGUF file + 128 MiB. Resident memory of the stage processes
after a short generation. `python benchmarks/pipeline_memory.py [--json PATH]`"""
import argparse
import json
import os
import subprocess
import sys

from pipellm import LLM, SamplingParams
from pipellm.loader.default_model import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    idle = int(subprocess.run([sys.executable, "-c", "import os, torch; print(int(open('/proc/self/statm').read()"
                               ".split()[1]) * os.sysconf('SC_PAGE_SIZE'))"],
                              capture_output=True, text=True, check=True).stdout)
    file_bytes = os.path.getsize(default_model_path())
    with LLM(pipeline_parallel_size=2, kv_cache_gib=1 / 16, max_model_len=1024) as llm:
        llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        stages = [r.rss_bytes for r in llm.engine.inspect()]
    target = 2 * idle + 1.15 * file_bytes + 128 * 2 ** 20
    result = dict(idle_torch_bytes=idle, file_bytes=file_bytes, stage_rss_bytes=stages, target_bytes=target,
                  ratio=sum(stages) / target)
    each = ", ".join(f"{r / 1e6:.0f}" for r in stages)
    print(f"idle torch {idle / 1e6:.0f} MB, file {file_bytes / 1e6:.0f} MB; stages {each} MB, "
          f"{sum(stages) / 1e6:.0f} MB in all against the target's {target / 1e6:.0f} MB: {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
