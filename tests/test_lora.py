"""LoRA adapters (enable_lora): requests of different adapters, and of none, in one batch, each greedy token for token
what HF transformers gives with PEFT's model of that adapter."""
import copy
import json
import os

import httpx
import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from pipellm import LLM, LoRARequest, SamplingParams
from pipellm.sampling_params import BeamSearchParams
from tests.conftest import FP32, hf_greedy_ids, make_checkpoint
from tests.serving import serve

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N = 10
PROMPTS = [[5, 9, 33, 7, 100, 3, 8], list(range(40, 75))]  # the second fills two blocks of 16: a cached prefix
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def save_adapter(base, folder: str, seed: int, targets: list[str], **config):
    """A PEFT adapter of random A and B (PEFT's own init leaves B zero: no change to see), saved as PEFT saves it;
    returns HF's model with the adapter."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=targets, init_lora_weights=False,
                                                                      **config))
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(base folder, {adapter name: (LoRARequest, HF greedy ids of PROMPTS)} and HF's beam search with the first
    adapter ("all-beams": 3 beams of 5 tokens after PROMPTS[0]), HF base ids)."""
    d = tmp_path_factory.mktemp("lora")
    base = make_checkpoint("llama", str(d / "base"), seed=3)
    adapters = {}
    for i, (name, targets, config) in enumerate([
            ("all", ALL, dict(r=8, lora_alpha=16)),
            ("qv-rslora", ["q_proj", "v_proj"], dict(r=4, lora_alpha=32, use_rslora=True)),
            ("mlp-pattern", ["gate_proj", "down_proj"], dict(r=6, lora_alpha=6, alpha_pattern={"down_proj": 24}))]):
        model = save_adapter(base, str(d / name), i + 1, targets, **config)
        adapters[name] = (LoRARequest(name, i + 1, str(d / name)), hf_greedy_ids(model, PROMPTS, N))
        if name == "all":
            with torch.no_grad():
                beams = model.generate(torch.tensor([PROMPTS[0]]), num_beams=3, num_return_sequences=3,
                                       max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
            adapters["all-beams"] = beams.tolist()
    return str(d / "base"), adapters, hf_greedy_ids(base, PROMPTS, N)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("pp", [1, 2])
def test_a_batch_of_adapters_and_the_base_model_matches_peft(lora_setup, pp):
    base_dir, adapters, base_ids = lora_setup
    names = ["all", "qv-rslora", "mlp-pattern"]
    loras = [None] * 2 + [adapters[n][0] for n in names for _ in PROMPTS]
    with LLM(base_dir, pipeline_parallel_size=pp, dtype=FP32, enable_lora=True, max_loras=3,
             max_lora_rank=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * (1 + len(names)), GREEDY,
                            lora_request=loras, use_tqdm=False)
    got = _ids(outs)
    assert got[:2] == base_ids
    for i, name in enumerate(names):
        assert got[2 + 2 * i:4 + 2 * i] == adapters[name][1], name
    assert [o.lora_request for o in outs] == loras
    assert base_ids != adapters["all"][1]  # the adapters change the output: the comparison can fail


def test_adapters_share_one_slot_and_no_cached_prefix(lora_setup):
    """max_loras=1: two adapters' requests take turns in the slot. A prompt cached under one adapter (or none) is
    computed again under another: its K/V differ. A beam search with an adapter: HF's with PEFT's model."""
    base_dir, adapters, base_ids = lora_setup
    a, b = (adapters[n] for n in ("all", "qv-rslora"))
    with LLM(base_dir, pipeline_parallel_size=2, dtype=FP32, enable_lora=True, max_loras=1,
             max_lora_rank=8) as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base_ids
        assert _ids(llm.generate(prompts, GREEDY, lora_request=a[0], use_tqdm=False)) == a[1]
        outs = llm.generate(prompts * 2, GREEDY, lora_request=[b[0], b[0], a[0], a[0]], use_tqdm=False)
        assert _ids(outs) == b[1] + a[1]
        # the base model again, after the adapters: its cached prefix is its own
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base_ids
        beams = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True),
                                lora_request=a[0])
        assert [s.tokens for s in beams[0].sequences] == adapters["all-beams"]


def test_mistakes_are_refused_before_anything_runs(lora_setup, tmp_path):
    base_dir, adapters, base_ids = lora_setup
    lora = adapters["all"][0]
    with pytest.raises(ValueError, match="not a folder"):
        LoRARequest("x", 1, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, lora.lora_path)
    with LLM(base_dir, dtype=FP32) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate("Hello", GREEDY, lora_request=lora, use_tqdm=False)
    other = tmp_path / "other"
    # another model's adapter: its shapes differ
    save_adapter(make_checkpoint("llama", str(other / "base"), hidden_size=32), str(other / "lora"), 0, ["q_proj"],
                 r=4)
    bad_config = tmp_path / "dora"
    bad_config.mkdir()
    cfg = json.load(open(os.path.join(lora.lora_path, "adapter_config.json")))
    json.dump(cfg | {"use_dora": True}, open(bad_config / "adapter_config.json", "w"))
    save_file(load_file(os.path.join(lora.lora_path, "adapter_model.safetensors")),
              str(bad_config / "adapter_model.safetensors"))
    embed = tmp_path / "embed"
    embed.mkdir()
    json.dump(cfg, open(embed / "adapter_config.json", "w"))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(384, 4)}, str(embed / "adapter_model.safetensors"))
    small = adapters["qv-rslora"][0].lora_path
    with LLM(base_dir, dtype=FP32, enable_lora=True, max_lora_rank=4) as llm:
        for request, match in [
                (lora, "rank 8 is above max_lora_rank=4; start the engine with max_lora_rank=8"),
                (LoRARequest("other", 7, str(other / "lora")),
                 r"q_proj \(\[32, 32\] in the adapter\) is not a linear layer"),
                (LoRARequest("dora", 8, str(bad_config)), "use_dora"),
                (LoRARequest("embed", 9, str(embed)), "lm_head"),
                (LoRARequest("small", 9, small), None),  # rank 4: taken; then its name or id for another one
                (LoRARequest("again", 9, small), "lora_int_id 9 is already"),
                (LoRARequest("small", 10, small), "one name names one adapter")]:
            if match is None:
                llm.generate("Hello", SamplingParams(max_tokens=1), lora_request=request, use_tqdm=False)
                continue
            with pytest.raises(ValueError, match=match):  # the whole call refused: the first prompt did not run
                llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, lora_request=[None, request],
                             use_tqdm=False)
            assert not llm.engine.has_unfinished_requests()
        assert _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)) == base_ids


def test_a_gpt_neox_adapter_matches_peft_and_one_on_its_fused_qkv_is_refused(tmp_path):
    """GPT-NeoX's own names reach its adapters: one on its attention output and MLP (dense, dense_h_to_4h,
    dense_4h_to_h) equals PEFT's, over two stages; one on query_key_value, whose rows pipellm reorders, is refused by
    name before anything runs."""
    from tests.test_families import make_family_checkpoint

    base = make_family_checkpoint("gpt_neox", str(tmp_path / "base"))
    expected = hf_greedy_ids(save_adapter(base, str(tmp_path / "out"), 1, ["dense", "dense_h_to_4h",
                                                                          "dense_4h_to_h"], r=4), PROMPTS, N)
    save_adapter(base, str(tmp_path / "qkv"), 2, ["query_key_value"], r=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(tmp_path / "base"), dtype=FP32, enable_lora=True, max_lora_rank=4, pipeline_parallel_size=2) as llm:
        out = llm.generate(prompts, GREEDY, lora_request=LoRARequest("out", 1, str(tmp_path / "out")), use_tqdm=False)
        assert _ids(out) == expected
        with pytest.raises(ValueError, match=r"query_key_value \(\[192, 64\] in the adapter\) is not a linear "
                           "layer.*rows pipellm reorders"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("qkv", 2, str(tmp_path / "qkv")), use_tqdm=False)


def test_served_adapters_are_models_of_their_own(lora_setup, tmp_path):
    base_dir, adapters, base_ids = lora_setup
    lora, ids = adapters["all"]
    with serve(base_dir, tmp_path, "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
               f"mine={lora.lora_path}") as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base_dir, None), ("mine", base_dir)]
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        for model, want in ((base_dir, base_ids[0]), ("mine", ids[0])):
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            assert answer["model"] == model
            assert answer["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
        missing = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=60)
        assert missing.status_code == 404 and "'mine'" in missing.json()["error"]["message"]
        metrics = httpx.get(f"{server.url}/metrics").text  # vLLM's gauge of the adapters in use: none now
        assert 'pipellm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        off = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": lora.lora_path})
        assert off.status_code == 404 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]


def test_adapters_added_and_removed_while_serving(lora_setup, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: each adapter's completions are PEFT's, also for a
    prompt cached under the adapter the same name held before, in the one slot that adapter held."""
    base_dir, adapters, base_ids = lora_setup
    tokenizer = AutoTokenizer.from_pretrained(base_dir)

    with serve(base_dir, tmp_path, "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating") as server:
        def post(route: str, **body) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)

        def text(model: str) -> str | int:  # the completion of the cached prompt, or the status of a refusal
            r = post("completions", model=model, prompt=PROMPTS[1], max_tokens=N, temperature=0, ignore_eos=True)
            return r.json()["choices"][0]["text"] if r.status_code == 200 else r.status_code

        def served() -> list[str]:
            return [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]

        def want(name: str) -> str:
            return tokenizer.decode(adapters[name][1][1], skip_special_tokens=True)

        assert text("mine") == 404
        load = post("load_lora_adapter", lora_name="mine", lora_path=adapters["all"][0].lora_path)
        assert load.status_code == 200 and load.text == "Success: LoRA adapter 'mine' added successfully."
        assert served() == [base_dir, "mine"] and text("mine") == want("all")
        qv = adapters["qv-rslora"][0].lora_path
        for body, status, match in [
                (dict(lora_name="mine", lora_path=qv), 400, "load_inplace"),
                (dict(lora_name=base_dir, lora_path=qv), 400, "taken"),
                (dict(lora_name="x", lora_path=str(tmp_path / "missing")), 400, "not a folder"),
                (dict(lora_name="x", lora_path=str(tmp_path)), 400, "adapter_config.json"),
                (dict(lora_name="x"), 400, "lora_path"),
        ]:
            r = post("load_lora_adapter", **body)
            assert r.status_code == status and match in r.json()["error"]["message"], (body, r.text)
        assert served() == [base_dir, "mine"] and text("mine") == want("all")  # nothing changed
        assert post("load_lora_adapter", lora_name="mine", lora_path=qv, load_inplace=True).status_code == 200
        assert text("mine") == want("qv-rslora") != want("all")
        unload = post("unload_lora_adapter", lora_name="mine")
        assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'mine' removed successfully."
        assert served() == [base_dir] and text("mine") == 404
        assert post("unload_lora_adapter", lora_name="mine").status_code == 404
        assert post("load_lora_adapter", lora_name="mine", lora_path=adapters["all"][0].lora_path).status_code == 200
        assert text("mine") == want("all")
        assert text(base_dir) == tokenizer.decode(base_ids[1], skip_special_tokens=True)


def test_an_adapter_removed_and_added_again_under_its_name_and_id_runs_its_new_files(lora_setup):
    """vLLM's LLMEngine.add_lora / remove_lora / list_loras: the name and id of a removed adapter may name another,
    whose requests then run it, not the one before in its slot, nor the K/V cached under it."""
    base_dir, adapters, base_ids = lora_setup
    (a, a_ids), (b, b_ids) = adapters["all"], adapters["qv-rslora"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(base_dir, dtype=FP32, enable_lora=True, max_lora_rank=8) as llm:
        engine = llm.llm_engine
        assert engine.add_lora(a) and engine.list_loras() == {a.lora_int_id}
        assert _ids(llm.generate(prompts, GREEDY, lora_request=a, use_tqdm=False)) == a_ids
        assert engine.remove_lora(a.lora_int_id) and engine.list_loras() == set()
        assert not engine.remove_lora(a.lora_int_id)
        again = LoRARequest(a.lora_name, a.lora_int_id, b.lora_path)
        assert _ids(llm.generate(prompts, GREEDY, lora_request=again, use_tqdm=False)) == b_ids


def test_a_request_whose_adapter_finds_no_free_slot_waits_and_the_others_go_ahead(tmp_path):
    from pipellm.engine.block_manager import BlockManager
    from pipellm.engine.scheduler import Scheduler
    from pipellm.engine.sequence import Request
    from tests.test_scheduler import _return_tokens

    for name in "AB":
        (tmp_path / name).mkdir()
    lora = {name: LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate("AB")}
    sched = Scheduler(BlockManager(num_blocks=32, block_size=4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_loras=1)
    reqs = {}
    for rid, name in [("a", "A"), ("b", "B"), ("c", None), ("d", "A")]:
        reqs[rid] = Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 0, 1, lora_request=lora.get(name))
        sched.add(reqs[rid])
    first = sched.schedule()
    assert [r.request_id for r in first.requests] == ["a", "c", "d"]  # b's B waits for A's slot
    assert first.stage_batch.lora_slots.tolist() == [0, -1, 0]
    assert [(x.slot, x.path) for x in first.stage_batch.lora_loads] == [(0, str(tmp_path / "A"))]
    _return_tokens(first)
    for rid in "acd":
        sched.finish(reqs[rid], "length")
    second = sched.schedule()
    assert [r.request_id for r in second.requests] == ["b"]
    assert second.stage_batch.lora_slots.tolist() == [0]
    assert [(x.slot, x.path) for x in second.stage_batch.lora_loads] == [(0, str(tmp_path / "B"))]
    sched.requeue_all(BlockManager(num_blocks=32, block_size=4))  # new stages: b's adapter is loaded again
    third = sched.schedule()
    assert [(x.slot, x.path) for x in third.stage_batch.lora_loads] == [(0, str(tmp_path / "B"))]


def test_an_adapter_over_a_gguf_models_compact_weights(tmp_path, monkeypatch):
    """A PEFT adapter trained on the HF model a GGUF file came from runs over the file's compact weights (Q4_0, Q4_1,
    Q8_0, F16, BF16; q and k in llama.cpp's row order in the file): PEFT's model on those weights dequantized."""
    from transformers import AutoModelForCausalLM

    from pipellm.loader.gguf import convert_gguf
    from tests.test_gguf import write_tiny_gguf

    monkeypatch.setenv("PIPELLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    convert_gguf(str(path), str(tmp_path / "hf"))
    model = save_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), str(tmp_path / "lora"), 5, ALL,
                         r=8, lora_alpha=8)
    prompts = [[5, 80, 100, 7], [260, 3, 3, 40, 41, 42, 43, 44, 45]]
    with LLM(str(path), pipeline_parallel_size=2, dtype=FP32, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            lora_request=LoRARequest("tiny", 1, str(tmp_path / "lora")), use_tqdm=False)
    want = hf_greedy_ids(model, prompts, N)
    assert _ids(outs) == want
    with model.disable_adapter():
        assert hf_greedy_ids(model, prompts, N) != want  # the adapter changes the output: the comparison can fail


def test_the_server_s_engine_refuses_a_request_whose_adapter_name_changed_hands(lora_setup):
    """Through the server's AsyncEngine: a request naming an adapter whose name was given to another one meanwhile
    (replaced while the request was on its way to the engine thread) ends with RequestRefusedError (the server's
    400), and the requests after it run."""
    import asyncio

    from pipellm.config import EngineConfig
    from pipellm.engine.async_engine import AsyncEngine, RequestRefusedError
    from pipellm.engine.engine import LLMEngine

    base_dir, adapters, _ = lora_setup
    (a, a_ids), (b, _) = adapters["all"], adapters["qv-rslora"]
    engine = LLMEngine(EngineConfig(base_dir, dtype=FP32, enable_lora=True, max_lora_rank=8))

    async def run():
        async_engine = AsyncEngine(engine)
        async_engine.start()

        async def tokens(lora):
            return [t async for deltas in async_engine.generate(f"r{id(lora)}", PROMPTS[0], GREEDY, lora_request=lora)
                    for d in deltas for t in d.token_ids]
        try:
            assert await async_engine.call(lambda e: e.add_lora(a))
            with pytest.raises(RequestRefusedError, match="one name names one adapter"):
                await tokens(LoRARequest(a.lora_name, 99, b.lora_path))
            return await tokens(a)
        finally:
            async_engine.stop()
    try:
        assert asyncio.run(run()) == a_ids[0]
    finally:
        engine.shutdown()
