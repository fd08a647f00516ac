"""A stage loads an HF checkpoint tensor by tensor: a bf16 checkpoint never has an fp32 copy, and with quantization
the stage never holds all its linear weights dense. Measured in a fresh process (its heap not reused from earlier
tests): the anonymous memory (/proc/self/status RssAnon, the file's mapping aside) as each parameter is filled."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import hf_config

PROBE = """
import json, sys, torch
from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from pipellm.quant.linear import weight_bytes
from pipellm.quant.rtn import LoadQuantizer

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

folder, dtype, method = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] or None
cfg = ModelConfig.from_pretrained(folder)
model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True), meta=True)
quantize = LoadQuantizer(model, method) if method else None
base = peak = anon()
def filled(name):
    global peak
    if quantize:
        quantize(name)
    peak = max(peak, anon())
load_stage_weights(model, folder, dtype, filled)
print(json.dumps({"peak": peak - base, "held": anon() - base, "weights": sum(b for _, b in weight_bytes(model)),
                  "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
"""


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A Llama of 55M parameters (110 MB in bf16) saved in bf16: big enough that its weights dwarf one tensor."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp("bf16"))
    torch.manual_seed(0)
    cfg = hf_config("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                    num_key_value_heads=8)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder, sum(p.numel() * p.element_size() for p in model.parameters())


def _load(folder: str, dtype: str, method: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, folder, dtype, method], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_bf16_checkpoint_loads_without_an_fp32_copy(bf16_dir):
    folder, bf16_bytes = bf16_dir
    got = _load(folder, "bfloat16")
    assert got["dtypes"] == ["torch.bfloat16"] and got["weights"] == bf16_bytes
    # fp32 parameters, filled then cast, would reach 2x the bf16 bytes and drop back to 1x: nothing beyond what
    # is held at the end may exist on the way (the margin: one tensor read, allocator slack)
    assert got["held"] < 1.4 * bf16_bytes, (got, bf16_bytes)
    assert got["peak"] < got["held"] + 0.15 * bf16_bytes, (got, bf16_bytes)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_on_load_never_holds_the_stage_dense(bf16_dir, method):
    folder, bf16_bytes = bf16_dir
    got = _load(folder, "float32", method)
    # int8 keeps ~0.53x the bf16 bytes, int4 ~0.3x; quantizing once the whole stage is loaded would first hold it
    # dense in fp32, 2x. On the way: one layer dense, the quantizer's temporaries.
    assert got["weights"] < 0.6 * bf16_bytes
    assert got["peak"] < got["held"] + 0.25 * bf16_bytes, (got, bf16_bytes)
