"""A GPU stage's decode steps as its CUDA graphs run them (pipeline/graphs.py): padded to a graph's batch and
context, with the padding rows writing to the scratch block. Here on the CPU, without the capture (capture=False
runs the same ops eagerly); benchmarks/gpu_check.py checks the captured graphs on a GPU."""
import numpy as np
import pytest
import torch

from pipellm import kernels
from pipellm.config import EngineConfig
from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.pipeline import graphs
from pipellm.pipeline.partition import StageLayers
from tests.test_attention import interpreted_gpu_kernels
from tests.test_fused import BLOCK, PROMPTS, WIDTH, _step, _tables, folders  # noqa: F401 (a fixture)

SCRATCH = 3 * WIDTH  # the block past the tables' 3 * WIDTH


def _stages(folder: str, split: int | None):
    """The model whole, or as two stages split before layer `split`."""
    cfg = ModelConfig.from_pretrained(folder)
    n = cfg.num_layers
    bounds = [(0, n)] if split is None else [(0, split), (split, n)]
    stages = []
    for rank, (start, end) in enumerate(bounds):
        model = build_stage_model(cfg, StageLayers(rank, start, end, rank == 0, end == n))
        load_stage_weights(model, folder, torch.float32)
        transpose_linears(model)
        stages.append(model.eval())
    return cfg, stages


def _caches(cfg, model) -> list[KVCache]:
    return [KVCache.allocate(SCRATCH + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32) for _ in model.layers]


@pytest.mark.parametrize("path", ["kernels", "torch-ops", "triton"])
@pytest.mark.parametrize("arch,split", [("llama", None), ("llama", 1), ("gemma3", None), ("gpt2", None)])
def test_padded_decode_steps_equal_the_eager_steps(folders, monkeypatch, arch, split, path):  # noqa: F811
    """Three ragged sequences decode 3 steps: padded to 4 rows and a power of two of blocks, each step's hidden
    states equal the eager step's within fp32's rounding (1e-5, and 4e-6 of the largest value, ~30: torch's
    matmuls round 4 rows unlike 3), and so do the caches' blocks the driver owns. torch-ops: the kernels off (SDPA
    over the gathered blocks with the graph's mask, a GPU's path without Triton); triton: the decodes in a GPU's
    Triton kernel, run by Triton's interpreter (the C++ kernels off too). Gemma 3 mixes sliding and full layers."""
    calls, failures = [], []
    if path != "kernels":  # as on a GPU, where our C++ kernels do not run, a layer's or a whole decoder stack's
        monkeypatch.setattr(kernels, "for_tensor", lambda x: None)
        monkeypatch.setattr("pipellm.models.fused.applies", lambda x, meta: False)
    if path == "triton":
        gpu = interpreted_gpu_kernels(monkeypatch)
        monkeypatch.setattr(kernels, "GPU_FAILURE", failures)
        monkeypatch.setattr("pipellm.models.attention.decode_kernels", lambda q: calls.append(1) or gpu)
    cfg, stages = _stages(folders(arch), split)
    tables = _tables(2)
    runs = []
    for padded in (False, True):
        caches = [_caches(cfg, m) for m in stages]
        outs, lens = [], [len(p) for p in PROMPTS]
        x = PROMPTS
        for m, c in zip(stages, caches):  # the prompts, eagerly
            x = (_step(m, x, [0] * 3, tables, c) if m.stage.is_first
                 else _hidden_step(m, x, [len(p) for p in PROMPTS], [0] * 3, tables, c))
        step_graphs = [graphs.DecodeGraphs(m, c, [cfg.is_sliding(i) for i in range(m.stage.start, m.stage.end)],
                                           cfg.sliding_window, BLOCK, max_num_seqs=8, capture=False)
                       for m, c in zip(stages, caches)]
        for d in range(3):
            ids = [[(11 * d + s) % 384] for s in range(3)]
            if padded:
                positions = np.array(lens)
                slots = tables.numpy()[np.arange(3), positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
                x = np.array([i[0] for i in ids])
                with torch.inference_mode():
                    for g in step_graphs:
                        x = g.run(x, positions, positions + 1, tables.numpy(), slots)
            else:
                x = ids
                for m, c in zip(stages, caches):
                    x = _step(m, x, lens, tables, c) if m.stage.is_first else _hidden_step(m, x, [1] * 3, lens,
                                                                                            tables, c)
            outs.append(x)
            lens = [n + 1 for n in lens]
        runs.append((outs, caches))
    (eager, eager_caches), (padded, padded_caches) = runs
    for a, b in zip(eager, padded):
        err, scale = (b - a).abs().max().item(), a.abs().max().item()
        assert err <= 1e-5 + 4e-6 * scale, (err, scale)
    for stage_a, stage_b in zip(eager_caches, padded_caches):
        for a, b in zip(stage_a, stage_b):
            torch.testing.assert_close(b.k[:SCRATCH], a.k[:SCRATCH], atol=1e-5, rtol=0)
            torch.testing.assert_close(b.v[:SCRATCH], a.v[:SCRATCH], atol=1e-5, rtol=0)
    assert not failures and bool(calls) == (path == "triton")


def _hidden_step(model, hidden, query_lens: list[int], starts: list[int], tables, caches):
    """_step for a stage after the first: hidden [T, hidden] in, query_lens new tokens a sequence."""
    q = torch.tensor(query_lens)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)])
    rows = torch.repeat_interleave(torch.arange(len(starts)), q)
    slots = tables[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK
    cfg = model.cfg
    meta = AttentionMetadata.for_layers([cfg.is_sliding(i) for i in range(model.stage.start, model.stage.end)],
                                        cfg.sliding_window, positions, q, torch.tensor(starts) + q, tables, slots,
                                        BLOCK)
    with torch.inference_mode():
        return model(hidden, positions, meta, caches)


def test_padded_sizes():
    """Every batch and context fits the graph it takes, with little to spare."""
    for n in range(1, 513):
        b = graphs.padded_batch(n)
        assert n <= b and (b <= 4 or b - n < 8)
    for n in range(1, 600):
        b = graphs.padded_blocks(n)
        assert n <= b < 2 * n + 1 and (n <= 32 or b - n < 32)


def test_stages_that_take_graphs(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["llama"][0])
    config = EngineConfig(None, device="cpu")
    assert graphs.supported(cfg, config, torch.device("cpu"), 0) == "not a GPU"
    gpu = torch.device("cuda", 0)  # not used: supported() reads only its type
    assert graphs.supported(cfg, config, gpu, 0) is None
    assert graphs.supported(cfg, EngineConfig(None, enforce_eager=True), gpu, 0) == "enforce_eager"
    assert "int8" in graphs.supported(cfg, EngineConfig(None, kv_cache_dtype="int8"), gpu, 0)
    assert "rings" in graphs.supported(cfg, config, gpu, 8)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(None, enforce_eager="yes")


@pytest.mark.parametrize("arch,pp,steps", [("llama", 1, 1), ("llama", 2, 1), ("mistral", 2, 4), ("gpt2", 2, 1)])
def test_stages_with_graphs_match_hf(checkpoints, monkeypatch, arch, pp, steps):
    """The stages' use of the graphs (their inputs, the first stage's ids, the next stages' hidden states, multi-step
    decoding's fed-back samples): greedy ids equal HF's with every decode step padded as a graph runs it."""
    from pipellm import LLM, SamplingParams
    from tests.conftest import VOCAB, hf_greedy_ids

    monkeypatch.setenv(graphs.ON_CPU_ENV, "1")
    prompts = [[(7 * i + 3 * s + 1) % VOCAB for i in range(n)] for s, n in enumerate((5, 19, 40))]
    folder, hf = checkpoints[arch]
    with LLM(folder, pipeline_parallel_size=pp, dtype="float32", num_scheduler_steps=steps) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
        if pp == 1:  # the stage runs in this process: its graphs ran the decodes
            assert llm.engine.executor.worker.graphs.steps >= 11
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_ids(hf, prompts, 12)


def test_a_stage_keeps_the_graphs_it_used_last(checkpoints, monkeypatch):
    """At most MAX_GRAPHS shapes are kept; the one a step needs again moves to the back, the oldest goes."""
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    cfg, (model,) = _stages(checkpoints["llama"][0], None)
    g = graphs.DecodeGraphs(model, _caches(cfg, model), [False] * cfg.num_layers, None, BLOCK, 8, capture=False)
    tables = _tables(3).numpy()

    def step(num_seqs: int, context: int):
        pos = np.full(num_seqs, context - 1)
        slots = tables[np.arange(num_seqs), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
        with torch.inference_mode():
            g.run(np.arange(num_seqs), pos, pos + 1, tables[:num_seqs], slots)

    step(3, 5)   # 4 sequences, 2 blocks
    step(1, 5)   # 1, 2
    step(3, 6)   # 4, 2 again: to the back
    step(2, 9)   # 2, 4: the oldest, (1, 2), goes
    assert list(g.graphs) == [(4, 2), (2, 4)]


def test_a_capture_that_fails_leaves_the_steps_eager(checkpoints, monkeypatch, caplog):
    """A family whose ops a capture refuses still decodes: that step runs the same ops eagerly, later steps take the
    stage's eager path (applies() is False), and the log says why."""
    cfg, (model,) = _stages(checkpoints["llama"][0], None)
    caches = _caches(cfg, model)
    g = graphs.DecodeGraphs(model, caches, [False] * cfg.num_layers, None, BLOCK, 8, capture=True)

    def refuse(b, n):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(g, "_capture", refuse)
    tables = _tables(4)
    _step(model, PROMPTS, [0] * 3, tables, caches)
    lens = np.array([len(p) for p in PROMPTS])
    slots = tables.numpy()[np.arange(3), lens // BLOCK].astype(np.int64) * BLOCK + lens % BLOCK
    with torch.inference_mode():
        hidden = g.run(np.array([1, 2, 3]), lens, lens + 1, tables.numpy(), slots)
    expected = _step(model, [[1], [2], [3]], lens.tolist(), tables, [
        KVCache(c.k.clone(), c.v.clone()) for c in caches])  # the same step again, eagerly, on copies
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=0)
    assert g.failed == "operation not permitted when stream is capturing"
    assert not g.applies(np.ones(3, np.int64), lens + 2)
    assert "run eagerly" in caplog.text
