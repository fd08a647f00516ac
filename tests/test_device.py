"""The device a stage computes on. This machine has no GPU: these tests check the CPU path, the errors for a GPU that
is asked for and missing, and the parts of the GPU path that are plain torch on any device (the placement rules,
the memory plan against HF's own parameter count, compact weights made dense). benchmarks/gpu_check.sh runs the
parity and speed checks where a GPU is."""
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from torch import nn

from pipellm import LLM, SamplingParams, device
from pipellm.entrypoints.args import parse_args
from pipellm.entrypoints.cli import _engine_kwargs
from pipellm.model_config import ModelConfig
from pipellm.pipeline.partition import make_partition
from pipellm.quant.gguf_blocks import repack
from pipellm.quant.linear import CompactEmbedding, CompactLinear, densify
from tests.conftest import FP32, hf_config, hf_greedy_ids
from tests.test_families import family_config
from tests.test_quant import gguf_tensor

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the error is for one without")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_cuda_says_so_in_one_line(llama_dir, name):
    with pytest.raises(ValueError) as e:
        LLM(llama_dir, device=name)
    message = str(e.value)
    assert "\n" not in message and f"device={name!r}" in message and 'device="cpu"' in message
    assert ("CPU build" in message) == (torch.version.cuda is None)


@pytest.mark.parametrize("bad", [dict(device="tpu"), dict(device="cuda:x"), dict(device=""),
                                 dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5)])
def test_bad_device_options_name_the_field(llama_dir, bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        LLM(llama_dir, **bad)


@no_cuda
def test_auto_runs_on_the_cpu_here_and_matches_hf(checkpoints):
    folder, hf_model = checkpoints["llama"]
    prompts = [[1, 5, 9, 13, 2], [7, 3]]
    with LLM(folder, pipeline_parallel_size=2, dtype=FP32, device="auto") as llm:
        assert llm.engine.device == "cpu"
        assert [s["device"] for s in llm.engine.executor.stage_status()] == ["cpu", "cpu"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_ids(hf_model, prompts, 6)


def test_stage_placement_on_a_host_with_two_gpus():
    assert device.stage_device("cpu", 3, 4, num_gpus=0) == torch.device("cpu")
    assert device.stage_device("cuda", 1, 2, num_gpus=2) == torch.device("cuda", 1)
    assert device.stage_device("cuda:1", 2, 3, num_gpus=2) == torch.device("cuda", 1)  # shared, as asked
    with pytest.raises(ValueError, match=r"3 stages on this host but it has 2 GPU\(s\).*cuda:0"):
        device.stage_device("cuda", 0, 3, num_gpus=2)


def test_hidden_states_take_nccl_only_between_two_gpus():
    a, b = "cuda/GPU-aaaa", "cuda/GPU-bbbb"
    assert device.uses_nccl(a, b)
    assert not device.uses_nccl(a, a)  # one GPU: NCCL refuses two ranks on it
    assert not device.uses_nccl(a, "cpu/host1") and not device.uses_nccl("cpu/host1", "cpu/host1")


def test_cli_device_flags_reach_the_engine():
    kwargs = _engine_kwargs(parse_args(["bench", "--device", "cuda:1", "--gpu-memory-utilization", "0.5",
                                        "--enforce-eager"]))
    assert kwargs["device"] == "cuda:1" and kwargs["gpu_memory_utilization"] == 0.5 and kwargs["enforce_eager"]
    unset = _engine_kwargs(parse_args(["bench"]))  # the engine's defaults: cpu, CUDA graphs on a GPU
    assert "device" not in unset and "enforce_eager" not in unset


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3moe", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("pp", [1, 3])
def test_gpu_memory_plan_counts_the_parameters_hf_holds(tmp_path, family, pp):
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config("llama") if family == "llama" else family_config(family)
    hf_cfg.tie_word_embeddings = False
    hf = AutoModelForCausalLM.from_config(hf_cfg)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    planned = sum(device.stage_params(cfg, s) for s in make_partition(cfg.num_layers, pp))
    aside = sum(p.numel() for n, p in hf.named_parameters() if "norm" in n or n.endswith(".bias"))
    assert planned == sum(p.numel() for p in hf.parameters()) - aside


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_weights_made_dense_equal_the_gguf_dequantization(dtype):
    raws = [(T.Q4_K, 8), (T.Q8_0, 4)]
    parts = [repack(gguf_tensor(q, rows, 256, seed=i), q, rows, 256) for i, (q, rows) in enumerate(raws)]
    ref = torch.cat([torch.from_numpy(dequantize(gguf_tensor(q, rows, 256, seed=i), q).reshape(rows, 256))
                     for i, (q, rows) in enumerate(raws)])
    emb_raw = gguf_tensor(T.Q4_1, 10, 256, seed=5)
    emb_ref = torch.from_numpy(dequantize(emb_raw, T.Q4_1).reshape(10, 256))
    bias = torch.randn(12)
    model = nn.Module()
    model.block = nn.Module()
    model.block.proj = CompactLinear(parts, bias)
    model.embed = CompactEmbedding(repack(emb_raw, T.Q4_1, 10, 256), torch.float32)
    x = torch.randn(3, 256)
    before = model.block.proj(x)
    densify(model, dtype)
    proj, embed = model.block.proj, model.embed
    assert type(proj) is nn.Linear and type(embed) is nn.Embedding
    assert torch.equal(proj.weight, ref.to(dtype)) and torch.equal(proj.bias, bias.to(dtype))
    assert torch.equal(embed(torch.tensor([9, 0])), emb_ref[[9, 0]].to(dtype))
    if dtype == torch.float32:  # the compact kernel's product, within fp32 rounding of a 256-term sum
        tol = 1e-5 * (x.abs() @ ref.abs().t()).max().item()
        assert (proj(x) - before).abs().max().item() <= tol
    assert not any(isinstance(m, (CompactLinear, CompactEmbedding)) for m in model.modules())


@pytest.mark.parametrize("step", ["mixed", "decodes"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "gemma3"])
def test_a_stage_forward_keeps_every_tensor_on_the_stage_device(tmp_path, arch, step):
    """The GPU path's device discipline, on torch's meta device: an op mixing a tensor left on the CPU with the
    stage's raises, as on a GPU. A step of a prefill chunk and a decode, or of two decodes, then the LM head. (MoE
    layers count tokens per expert, which the meta device cannot: their ops are on x's device by reading.)"""
    from transformers import AutoModelForCausalLM

    from pipellm.models.attention import AttentionMetadata
    from pipellm.models.kv_cache import KVCache
    from pipellm.models.registry import build_stage_model
    from pipellm.pipeline.partition import StageLayers

    hf_cfg = family_config(arch) if arch == "gemma3" else hf_config(arch)
    AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True)).eval()
    meta_dev = torch.device("meta")
    model.to(meta_dev)
    caches = [KVCache.allocate(4, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, meta_dev)
              for _ in range(cfg.num_layers)]
    # sequence 0: a 5-token prompt in blocks 0, 1 (or its 5th token); sequence 1: its 8th token, in blocks 2, 3
    positions, query_lens, slots = ((torch.tensor([0, 1, 2, 3, 4, 7]), torch.tensor([5, 1]),
                                     torch.tensor([0, 1, 2, 3, 4, 15])) if step == "mixed" else
                                    (torch.tensor([4, 7]), torch.tensor([1, 1]), torch.tensor([4, 15])))
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    meta = AttentionMetadata.for_layers([cfg.is_sliding(i) for i in range(cfg.num_layers)], cfg.sliding_window,
                                        positions, query_lens, torch.tensor([5, 8]), tables, slots, 4)
    T = len(positions)
    with torch.inference_mode():
        hidden = model(torch.arange(1, T + 1, device=meta_dev), positions.to(meta_dev), meta.to(meta_dev), caches)
        logits = model.compute_logits(hidden[torch.tensor([T - 2, T - 1])])
    assert hidden.device == meta_dev and hidden.shape == (T, cfg.hidden_size)
    assert logits.device == meta_dev and logits.shape == (2, cfg.vocab_size)


def test_neighbours_on_two_gpus_pair_up_in_a_group_of_their_own(monkeypatch):
    """comm.nccl_links and the channel's hidden-state path, with gloo standing in for NCCL (no GPU here): stages 0
    and 1 on two GPUs get a group of the two, stage 2 shares stage 1's GPU and goes through host memory."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from pipellm.pipeline import comm

    class GlooAsNccl:
        Options = SimpleNamespace

        def __new__(cls, store, rank, size, opts):
            gloo = dist.ProcessGroupGloo._Options()
            gloo._timeout, gloo._devices = timedelta(seconds=30), [dist.ProcessGroupGloo.create_device(
                hostname="127.0.0.1")]
            return dist.ProcessGroupGloo(store, rank, size, gloo)

    monkeypatch.setattr(comm.dist, "ProcessGroupNCCL", GlooAsNccl, raising=False)
    master = comm.make_store("127.0.0.1", 0, is_master=True)
    identities = ["cuda/GPU-a", "cuda/GPU-b", "cuda/GPU-b"]
    chans, hidden = {}, torch.randn(3, 8)

    def stage_links(stage):  # each with a store client of its own, as a stage process has
        client = comm.make_store("127.0.0.1", master.port, is_master=False)
        store = comm.SignedStore(client, b"k" * 32).generation(0)
        store.set(comm.device_key(stage), identities[stage])
        chans[stage] = comm.Channel(None, comm.stage_world_rank(stage), 4, b"k" * 32, "")
        chans[stage].links = comm.nccl_links(store, stage, 3, identities[stage])

    threads = [threading.Thread(target=stage_links, args=(s,), daemon=True) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {s: set(c.links) for s, c in chans.items()} == {0: {2}, 1: {1}, 2: set()}  # world ranks of the peers
    received = {}
    receiver = threading.Thread(target=lambda: received.update(
        x=chans[1].recv_hidden((3, 8), torch.float32, 1, torch.device("cpu"))), daemon=True)
    receiver.start()
    chans[0].send_hidden(hidden, 2)
    receiver.join(60)
    chans[0].flush()
    assert torch.equal(received["x"], hidden)


def test_options_a_gpu_cannot_take_are_refused_naming_them():
    from pipellm.config import EngineConfig

    for bad in (dict(quantization="int8"), dict(int8_activations=True)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.*leave {next(iter(bad))} unset"):
            device.check_gpu_options(EngineConfig(None, **bad), "cuda")
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"{gpus + 1} stages on this host but it has {gpus} GPU"):
        device.check_gpu_options(EngineConfig(None, pipeline_parallel_size=gpus + 1), "cuda")
    device.check_gpu_options(EngineConfig(None, pipeline_parallel_size=gpus + 1), "cuda:0")  # one GPU, shared


def test_prefill_attention_on_a_gpu_leaves_cudnn_out():
    """cuDNN's attention plans each new shape (each prefill chunk's): a GPU's prefills take the flash and memory-
    efficient kernels, within the prefill loop only; a CPU's attention is untouched."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with device.prefill_attention_backends(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with device.prefill_attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_a_gpu_decode_kernel_that_fails_leaves_the_decodes_to_the_gather(monkeypatch, caplog):
    """Triton compiling for a GPU it was not checked on may raise: the step still attends, over gathered blocks
    (equal to the dense reference), one warning says why, and later steps go to the gather without trying again."""
    from pipellm import kernels
    from tests.test_attention import STEPS, _run

    calls = []

    class Failing:
        @staticmethod
        def paged_decode_attention(*args):
            calls.append(1)
            raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(kernels, "GPU_FAILURE", [])
    monkeypatch.setattr(kernels, "_triton_decode", lambda: Failing)
    monkeypatch.setattr("pipellm.models.attention.decode_kernels", lambda q: kernels.gpu())  # as for a GPU's q
    for step in range(2):
        out, dense = _run(STEPS["mixed"], 6, 2, None, seed=step)
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)
    assert len(calls) == 1 and kernels.gpu() is None
    assert [r.getMessage() for r in caplog.records if "GPU decode kernel failed" in r.getMessage()] == [
        "the GPU decode kernel failed (RuntimeError: PassManager::run failed); decodes gather their K/V blocks from "
        "now on"]


@no_cuda
def test_cli_cuda_without_cuda_names_the_flags(capsys, llama_dir):
    from pipellm.entrypoints.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["generate", llama_dir, "hi", "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: --device 'cuda': ") and err.endswith("--device cpu"), err
