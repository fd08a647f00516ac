"""Memory a stage needs to load an HF checkpoint: the default model's weights as fp32 and bf16 safetensors folders
(made from its GGUF file), the first of two stages built by the stage's own code (StageWorker) in a fresh process,
as bf16 and quantized on load to int8 and int4. A thread samples the process's anonymous memory (RssAnon: the
checkpoint file's mapping aside) every 0.5 ms; printed: its peak during the load and what is held after.
    python benchmarks/load_memory.py [--json PATH]
Run with PYTHONPATH set to another checkout to measure that one's loader on the same folders.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

PROBE = """
import json, sys, threading, time, torch
from pipellm.config import EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline.messages import StageArgs
from pipellm.pipeline.partition import make_partition
from pipellm.pipeline.stage import _release_free_heap
from pipellm.pipeline.worker import StageWorker

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

folder, dtype, quantization = sys.argv[1], sys.argv[2], sys.argv[3] or None
cfg = ModelConfig.from_pretrained(folder)
ecfg = EngineConfig(folder, pipeline_parallel_size=2, dtype=dtype, quantization=quantization)
args = StageArgs(make_partition(cfg.num_layers, 2)[0], 2, folder, cfg, ecfg, num_blocks=16)
sys.setswitchinterval(1e-4)
base = peak = anon()
done = False
def sample():
    global peak
    while not done:
        peak = max(peak, anon())
        time.sleep(5e-4)
thread = threading.Thread(target=sample)
thread.start()
worker = StageWorker(args)
_release_free_heap()  # as the stage does once loaded
done = True
thread.join()
print(json.dumps({"peak": peak - base, "held": anon() - base}))
"""


def bf16_copy(src: str, dst: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import convert_gguf

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        fp32, bf16 = os.path.join(tmp, "fp32"), os.path.join(tmp, "bf16")
        convert_gguf(default_model_path(), fp32)
        bf16_copy(fp32, bf16)
        for name, folder, dtype, quantization in [("bf16 checkpoint as bfloat16", bf16, "bfloat16", ""),
                                                  ("fp32 checkpoint as bfloat16", fp32, "bfloat16", ""),
                                                  ("fp32 checkpoint, int8 on load", fp32, "float32", "int8"),
                                                  ("fp32 checkpoint, int4 on load", fp32, "float32", "int4")]:
            out = subprocess.run([sys.executable, "-c", PROBE, folder, dtype, quantization], capture_output=True,
                                 text=True, timeout=600)
            if out.returncode:
                sys.exit(out.stderr[-2000:])
            r = json.loads(out.stdout.splitlines()[-1]) | {"case": name}
            results.append(r)
            print(f"{name}: peak {r['peak'] / 1e6:.0f} MB while loading, {r['held'] / 1e6:.0f} MB held after",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
