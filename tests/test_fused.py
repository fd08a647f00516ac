"""Decode steps through the kernels' DecoderStack (models/fused.py) against the layers' own forward, which every
other step takes, and against HF transformers' logits."""
import pytest
import torch

from pipellm import kernels
from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models import fused
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from pipellm.quant import linear
from pipellm.quant.rtn import quantize_linears

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="the kernels do not build on this platform "
                                   "(tests/test_quant.py::test_kernels_build_here fails then)")
BLOCK = 4
# ragged, and two longer than the sliding layers' window (24) of the families that have one
PROMPTS = [[(5 * i + 7 * s + 1) % 384 for i in range(n)] for s, n in enumerate((29, 3, 41))]
WIDTH = 12  # blocks a sequence


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory):
    """arch -> checkpoint folder: conftest's, and families with q/k norms (qwen3), Gemma's norms, GeGLU and sliding
    layers of their own rotary (gemma3), soft-capped scores (gemma2) or experts (mixtral); built on first use."""
    from tests.test_families import make_family_checkpoint

    built = {arch: folder for arch, (folder, _) in checkpoints.items()}

    def get(arch: str) -> str:
        if arch not in built:
            folder = str(tmp_path_factory.mktemp(arch))
            make_family_checkpoint(arch, folder)
            built[arch] = folder
        return built[arch]
    return get


def _stage(folder: str, quantization: str | None, dtype: torch.dtype = torch.float32):
    cfg = ModelConfig.from_pretrained(folder)
    model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True))
    load_stage_weights(model, folder, dtype)
    if quantization:
        quantize_linears(model, quantization)
    transpose_linears(model)
    return cfg, model.eval()


def _tables(seed: int) -> torch.Tensor:
    """[3, WIDTH] block ids, every sequence's blocks scattered over the cache, none in order."""
    return torch.randperm(3 * WIDTH, generator=torch.Generator().manual_seed(seed)).view(3, WIDTH).int()


def _step(model, ids: list[list[int]], starts: list[int], tables: torch.Tensor, caches) -> torch.Tensor:
    """One step: for each sequence, its new ids at positions start.. Returns the last stage's hidden states."""
    q = torch.tensor([len(i) for i in ids])
    positions = torch.cat([torch.arange(s, s + len(i)) for s, i in zip(starts, ids)])
    seq = torch.tensor([s + len(i) for s, i in zip(starts, ids)])
    rows = torch.repeat_interleave(torch.arange(len(ids)), q)
    slots = tables[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK
    cfg = model.cfg
    meta = AttentionMetadata.for_layers([cfg.is_sliding(i) for i in range(cfg.num_layers)], cfg.sliding_window,
                                        positions, q, seq, tables, slots, BLOCK)
    with torch.inference_mode():
        return model(torch.tensor([t for i in ids for t in i]), positions, meta, caches)


def _decode_run(model, cfg, kv_dtype, decodes: int) -> tuple[list[torch.Tensor], list[KVCache]]:
    caches = [KVCache.allocate(3 * WIDTH, BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype) for _ in model.layers]
    tables = _tables(0)
    _step(model, PROMPTS, [0, 0, 0], tables, caches)  # a prefill step: the layers' own path
    outs, lens = [], [len(p) for p in PROMPTS]
    for d in range(decodes):
        outs.append(_step(model, [[(11 * d + s) % 384] for s in range(3)], lens, tables, caches))
        lens = [n + 1 for n in lens]
    return outs, caches


def _fused_equals_layers(model, cfg, kv: str, monkeypatch, fused_expected: bool) -> list[torch.Tensor]:
    """Three decode steps (the stack, where fused_expected), then the same through the layers' forward: the same
    bits, in the outputs and in every cache. Returns the outputs."""
    dtype = getattr(torch, kv) if kv != "int8" else torch.int8
    outs, caches = _decode_run(model, cfg, dtype, 3)
    assert (model._fused[1] is not None) == fused_expected
    monkeypatch.setattr(fused, "applies", lambda x, meta: False)
    ref_outs, ref_caches = _decode_run(model, cfg, dtype, 3)
    for a, b in zip(outs, ref_outs):
        assert torch.equal(a, b)
    for a, b in zip(caches, ref_caches):
        assert all(torch.equal(x, y) for x, y in zip((a.k, a.v, a.k_scale, a.v_scale), (b.k, b.v, b.k_scale, b.v_scale))
                   if x is not None)
    return outs


@needs_kernels
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3moe"])
def test_fused_decode_equals_the_layers(folders, monkeypatch, arch, quantization, kv):
    """Same kernels in the same order: the same bits, in the outputs and in every cache. Mistral's layers all slide
    (window 24, shorter than the contexts), Gemma 2's and 3's mix sliding and full ones, Gemma 2's scores are
    soft-capped; Mixtral and Qwen3-MoE route each token to experts (Qwen3-MoE's layer 1 is dense)."""
    cfg, model = _stage(folders(arch), quantization)
    _fused_equals_layers(model, cfg, kv, monkeypatch, fused_expected=True)


@needs_kernels
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3", "mixtral"])
def test_fused_bf16_decode_equals_the_layers(folders, monkeypatch, arch, kv):
    """bf16 rows (dtype="bfloat16") with compact weights: the same bits as the layers' forward, outputs and caches.
    Llama's norms run bf16 rows in the kernel, Gemma's do not, and the stack leaves Gemma (and experts) to the
    layers. bf16 rows go to the kernels as they are where the CPU has bf16 instructions; elsewhere the test makes
    them go too, so that the path is checked on every machine."""
    monkeypatch.setattr(linear, "bf16_rows_to_kernels", lambda: True)
    cfg, model = _stage(folders(arch), "int8", torch.bfloat16)
    outs = _fused_equals_layers(model, cfg, kv, monkeypatch, fused_expected=arch in ("llama", "mistral", "qwen3"))
    assert outs[0].dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_logits_match_hf(checkpoints, arch):
    folder, hf = checkpoints[arch]
    cfg, model = _stage(folder, None)
    caches = [KVCache.allocate(3 * WIDTH, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32) for _ in model.layers]
    tables = _tables(1)
    _step(model, [p[:-1] for p in PROMPTS], [0, 0, 0], tables, caches)
    hidden = _step(model, [p[-1:] for p in PROMPTS], [len(p) - 1 for p in PROMPTS], tables, caches)
    assert model._fused[1] is not None
    with torch.no_grad():
        logits = model.compute_logits(hidden)
        for row, prompt in enumerate(PROMPTS):
            expected = hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)


def test_without_the_kernels_decode_steps_take_the_layers(folders, monkeypatch):
    """No DecoderStack where the kernels are not built: the layers' forward decodes, as every other step."""
    cfg, model = _stage(folders("gemma3"), None)
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    outs, _ = _decode_run(model, cfg, torch.float32, 1)
    assert model._fused is not None and model._fused[1] is None  # asked for, and not built
    assert torch.isfinite(outs[0]).all()


def test_building_on_meta_skips_init_and_its_imports(checkpoints):
    """A stage built on the meta device runs no random init: its first call on a meta tensor would import torch's
    symbolic-shape machinery (sympy and ~800 modules, 68 MB of the process). torch.nn.init is left as it was."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from torch import nn
from pipellm.model_config import ModelConfig
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
init = nn.init.normal_
for arch, folder in {[(a, checkpoints[a][0]) for a in ("llama", "gpt2")]!r}:
    cfg = ModelConfig.from_pretrained(folder)
    model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True), meta=True)
    assert all(p.is_meta for p in model.parameters()), arch
assert "sympy" not in sys.modules
assert nn.init.normal_ is init
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@needs_kernels
def test_int8_activations_switched_on_reach_the_fused_path(checkpoints, monkeypatch):
    from pipellm.quant.linear import set_int8_activations

    cfg, model = _stage(checkpoints["llama"][0], "int8")
    caches = [KVCache.allocate(3 * WIDTH, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32) for _ in model.layers]
    tables, lens = _tables(0), [len(p) for p in PROMPTS]
    _step(model, PROMPTS, [0, 0, 0], tables, caches)
    _step(model, [[1], [2], [3]], lens, tables, caches)  # builds the stack for these caches, fp32 activations
    set_int8_activations(model, True)
    lens = [n + 1 for n in lens]
    before = [KVCache(c.k.clone(), c.v.clone(), None, None) for c in caches]
    out = _step(model, [[4], [5], [6]], lens, tables, caches)
    assert model._fused[1] is not None
    monkeypatch.setattr(fused, "applies", lambda x, meta: False)
    assert torch.equal(out, _step(model, [[4], [5], [6]], lens, tables, before))
