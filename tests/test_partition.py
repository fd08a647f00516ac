import pytest

from pipellm.config import EngineConfig
from pipellm.pipeline.partition import even_partition, make_partition
from tests.conftest import FP32


@pytest.mark.parametrize("layers,stages,expected", [
    (30, 2, [15, 15]), (30, 4, [8, 8, 7, 7]), (5, 3, [2, 2, 1]), (7, 7, [1] * 7), (10, 1, [10]), (31, 2, [16, 15]),
])
def test_even_partition_gives_leftovers_to_early_stages(layers, stages, expected):
    assert even_partition(layers, stages) == expected


def test_stage_layout_and_description():
    stages = make_partition(30, 2)
    assert [(s.start, s.end, s.is_first, s.is_last) for s in stages] == [(0, 15, True, False), (15, 30, False, True)]
    assert [s.describe() for s in stages] == ["stage 0: embed + layers 0-14", "stage 1: layers 15-29 + norm + lm_head"]
    assert make_partition(4, 1)[0].describe() == "stage 0: embed + layers 0-3 + norm + lm_head"
    assert [(s.start, s.end) for s in make_partition(30, 3, [10, 12, 8])] == [(0, 10), (10, 22), (22, 30)]


@pytest.mark.parametrize("stages,partition,message", [
    (5, None, "greater than the model's 4 layers"),
    (2, [1, 2], "sums to 3"),
    (2, [4, 0], "at least one layer"),
    (2, [2, 1, 1], "has 3 entries"),
])
def test_bad_partitions(stages, partition, message):
    with pytest.raises(ValueError, match=message):
        make_partition(4, stages, partition)


def test_balanced_partition_moves_layers_off_the_head_stage():
    from pipellm.pipeline.profile import LayerCosts, balanced_partition, stage_times

    costs = LayerCosts(layer_s=4e-3, embed_s=1e-4, head_s=20e-3, num_tokens=16)
    assert balanced_partition(30, 1, costs) == [30]
    assert balanced_partition(30, 2, costs) == [17, 13]  # 68.1 ms and 72.0 ms, against 60.1 / 80.0 for 15/15
    assert max(stage_times([17, 13], costs)) < max(stage_times([15, 15], costs))
    sizes = balanced_partition(30, 4, costs)
    assert sum(sizes) == 30 and min(sizes) >= 1 and sizes[-1] < sizes[0]
    # Without a head to carry, it is an even split with the leftovers early.
    assert balanced_partition(5, 3, LayerCosts(1.0, 0.0, 0.0, 1)) == [2, 2, 1]


def test_auto_partition_keeps_greedy_output(llama_dir, tmp_path, monkeypatch):
    from pipellm import LLM, SamplingParams

    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path))  # a fresh profile
    prompts = [{"prompt_token_ids": [(3 * i + j) % 300 + 1 for j in range(5 + 4 * i)]} for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, dtype=FP32) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(llama_dir, pipeline_parallel_size=3, layer_partition="auto", dtype=FP32) as auto:
        sizes = [s.num_layers for s in auto.engine.stages]
        assert sum(sizes) == 5 and min(sizes) >= 1
        assert auto.engine.partition_note.startswith("auto partition")
        assert [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)] == expected
    assert list((tmp_path / "profile").glob("*.json"))  # profiled once, kept for the next start


def test_auto_dtype(monkeypatch, tmp_path):
    from pipellm import kernels
    from pipellm.pipeline import profile

    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path))
    assert profile.auto_dtype(1, compact=True)[0] == "float32"  # our kernels take fp32 activations
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2"}))
    assert profile.auto_dtype(1, compact=False) == ("float32", "this CPU has no bf16 instructions")
    # a CPU with bf16 instructions: measured once, then read back from the cache
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    calls = []
    monkeypatch.setattr(profile, "_bf16_speedup", lambda n: calls.append(n) or {"ratio": 1.6})
    assert profile.auto_dtype(2, compact=False)[0] == "bfloat16"
    assert profile.auto_dtype(2, compact=False)[0] == "bfloat16" and calls == [2]
    monkeypatch.setattr(profile, "_bf16_speedup", lambda n: {"ratio": 0.7})
    assert profile.auto_dtype(1, compact=False)[0] == "float32"


def test_engine_resolves_auto_dtype(llama_dir):
    from pipellm import LLM, kernels
    from pipellm.pipeline import profile

    # the stages got a concrete dtype, the measured choice: float32 on a CPU without bf16 instructions
    with LLM(llama_dir, threads_per_stage=1) as llm:
        dtype = llm.engine.config.dtype
        assert [r.weight_bytes[0][0] for r in llm.engine.inspect()] == [{"float32": "F32"}.get(dtype, "BF16")]
    assert dtype == profile.auto_dtype(1, compact=False)[0]
    assert dtype == "float32" or kernels.has_bf16_matmul()


def test_partition_given_as_the_cli_writes_it():
    assert EngineConfig(None, 2, layer_partition="3, 1").layer_partition == [3, 1]
    assert EngineConfig(None, 2, layer_partition="auto").layer_partition == "auto"
    with pytest.raises(ValueError, match=r"layer_partition '3;1': give layer counts per stage, such as \"15,15\""):
        EngineConfig(None, 2, layer_partition="3;1")
