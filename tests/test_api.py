"""The vLLM-style API: inputs, outputs, sampling options, and errors that leave the engine usable."""
import math
import os
import re

import numpy as np
import pytest
import torch

from pipellm import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams, device
from pipellm.config import EngineConfig
from tests.conftest import FP32

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _ids(llm, prompt, params=GREEDY):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_output_shapes_and_prompt_forms(llm_pp2):
    tok = llm_pp2.get_tokenizer()
    outs = llm_pp2.generate(["The capital of France is", "Hello"], GREEDY, use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert outs[0].prompt == "The capital of France is"
    assert outs[0].prompt_token_ids == tok.encode("The capital of France is")
    assert outs[0].request_id != outs[1].request_id
    completion = outs[0].outputs[0]
    assert isinstance(completion, CompletionOutput)
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.logprobs is None
    # A single string, and token ids, give the same result as the batch.
    single = llm_pp2.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    by_ids = llm_pp2.generate({"prompt_token_ids": outs[0].prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == by_ids.outputs[0].token_ids == completion.token_ids
    assert by_ids.prompt is None


def test_batching_does_not_change_greedy_output(llm_pp2):
    prompts = [[5, 6, 7], [(3 * i) % 300 + 1 for i in range(30)], [1], [9] * 17]
    alone = [_ids(llm_pp2, p) for p in prompts]
    together = llm_pp2.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone


def test_stop_token_ids_end_with_reason_stop(llm_pp2):
    first = _ids(llm_pp2, [5, 6, 7])
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first[2]])
    out = llm_pp2.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[:3] and out.finish_reason == "stop" and out.stop_reason == first[2]


def test_stop_string_is_cut_from_text(llm_pp2):
    full = llm_pp2.generate("Once upon", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop = full.text[3:6]
    assert stop.strip(), "test needs a visible stop string"
    out = llm_pp2.generate("Once upon", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.find(stop)]
    kept = llm_pp2.generate("Once upon", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.find(stop) + len(stop)] and kept.token_ids == out.token_ids


def test_min_tokens_and_logit_bias_match_hf(llm_pp2, checkpoints):
    """HF transformers' own processors are the reference: min_new_tokens masks the EOS ids, sequence_bias adds to
    single tokens' logits."""
    model = checkpoints["llama"][1]

    def hf(prompt, **kwargs):
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  **kwargs)[0, len(prompt):].tolist()

    for prompt in ([5, 6, 7], [(7 * i + 3) % 300 for i in range(19)]):
        plain = _ids(llm_pp2, prompt)
        stop = plain[1]  # would end the output at its second token
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5, stop_token_ids=[stop])
        out = llm_pp2.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf(prompt, min_new_tokens=5, eos_token_id=[0, stop])
        assert len(out.token_ids) >= 5 and not {0, stop} & set(out.token_ids[:5])
        bias = {plain[0]: -100.0, plain[3]: 2.5}
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=bias)
        out = llm_pp2.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf(prompt, eos_token_id=None, sequence_bias={(t,): b for t, b in bias.items()})
        assert out.token_ids[0] != plain[0]


def test_min_tokens_holds_eos_back_under_ignore_eos_too(llm_pp2, checkpoints):
    """As vLLM's min_tokens and HF's min_new_tokens: before min_tokens, EOS is kept out even where ignore_eos lets
    it be drawn as any other token. This prompt's greedy continuation starts with EOS (id 0)."""
    model, prompt = checkpoints["llama"][1], [4, 288, 272, 256, 240]

    def hf(**kwargs):
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  **kwargs)[0, len(prompt):].tolist()

    drawn = _ids(llm_pp2, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert drawn == hf(eos_token_id=None) and drawn[0] == 0
    held = _ids(llm_pp2, prompt, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True))
    assert held == hf(min_new_tokens=8) and 0 not in held


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm_pp2):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    a = _ids(llm_pp2, [5, 6, 7], params)
    # Same seed, other requests in the batch: same tokens.
    batch = llm_pp2.generate([{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [5, 6, 7]}], params,
                             use_tqdm=False)
    assert batch[1].outputs[0].token_ids == a
    assert _ids(llm_pp2, [5, 6, 7], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)) != a
    two = llm_pp2.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True),
                           use_tqdm=False)[0]
    assert [c.index for c in two.outputs] == [0, 1]
    assert two.outputs[0].token_ids == a and two.outputs[1].token_ids != a


def test_logprobs_are_returned_per_token(llm_pp2):
    out = llm_pp2.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_past_max_logprobs_are_refused(llm_pp2, llama_dir):
    for name in ("logprobs", "prompt_logprobs"):  # vLLM's default cap: 20
        with pytest.raises(ValueError, match=rf"SamplingParams.{name}=21 is over the engine's max_logprobs=20"):
            llm_pp2.generate("Hello", SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
    with LLM(llama_dir, dtype=FP32, max_logprobs=-1) as llm:  # no cap: the whole vocabulary
        vocab = llm.engine.model_config.vocab_size
        out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    assert [len(e) for e in out.logprobs] == [vocab, vocab]
    assert [sum(math.exp(lp.logprob) for lp in e.values()) for e in out.logprobs] == pytest.approx([1, 1], abs=1e-4)
    with pytest.raises(ValueError, match="max_logprobs=-2: must be an integer >= 0, or -1"):
        EngineConfig(None, max_logprobs=-2)


def test_chat_applies_the_template(llm_pp2):
    tok = llm_pp2.get_tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    out = llm_pp2.chat(messages, GREEDY, use_tqdm=False)[0]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and out.prompt.endswith("<|assistant|>")
    assert out.outputs[0].token_ids == _ids(llm_pp2, tok.encode(text, add_special_tokens=False))


def test_bad_words_and_allowed_token_ids_match_hf(llm_pp2, checkpoints):
    """HF transformers' bad_words_ids and prefix_allowed_tokens_fn are the reference."""
    model, tok = checkpoints["llama"][1], llm_pp2.get_tokenizer()
    prompt = tok.encode("Once upon a time")
    plain = _ids(llm_pp2, prompt)
    words = [tok.decode(plain[1:3]).strip(), tok.decode(plain[5:6]).strip()]
    words_ids = [tok.encode(p + w, add_special_tokens=False) for w in words for p in ("", " ")]  # as documented
    allowed = sorted(set(range(40, 300)) - {plain[0]})

    def hf(**kwargs):
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  eos_token_id=None, **kwargs)[0, len(prompt):].tolist()

    out = _ids(llm_pp2, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=words))
    assert out == hf(bad_words_ids=words_ids) and out != plain
    out = _ids(llm_pp2, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                               allowed_token_ids=allowed))
    assert out == hf(prefix_allowed_tokens_fn=lambda batch, ids: allowed) and set(out) <= set(allowed)


def test_llm_chat_continues_a_message_and_passes_template_variables(llm_pp2):
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    prompt = llm_pp2.chat_prompt(prefix, add_generation_prompt=False, continue_final_message=True)["prompt"]
    assert prompt.endswith("<|assistant|>The answer is")
    template = "{{ messages[0]['content'] }}{% if x %}[{{ x }}]{% endif %}"
    assert llm_pp2.chat_prompt(prefix, chat_template=template, chat_template_kwargs={"x": 1})["prompt"] == "Hi[1]"
    with pytest.raises(ValueError, match="set add_generation_prompt to False"):
        llm_pp2.chat(prefix, continue_final_message=True)
    # the same checks as the server's chat completions (pipellm/chat.py), each naming what to change
    with pytest.raises(ValueError, match="chat_template_kwargs: tokenize are the request's own fields"):
        llm_pp2.chat_prompt(prefix, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="the chat template rejected these messages: roles must alternate"):
        llm_pp2.chat_prompt(prefix, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat_template_kwargs: messages are the request's own fields"):
        llm_pp2.chat_prompt(prefix, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="chat_template_kwargs must map the template's variables to values, not str"):
        llm_pp2.chat_prompt(prefix, chat_template_kwargs="x")


def test_llm_chat_takes_openai_text_parts_as_the_server_does(llm_pp2):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert llm_pp2.chat_prompt(parts) == llm_pp2.chat_prompt([{"role": "user", "content": "Hi\nthere"}])
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: only text parts"):
        llm_pp2.chat_prompt([{"role": "user", "content": [image]}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string or a list of text parts, not int"):
        llm_pp2.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": 5}], use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_end_of_a_long_prompt(llm_pp2):
    limit = llm_pp2.engine.max_model_len
    long = [(7 * i + 3) % 300 + 1 for i in range(limit + 50)]  # too long for the model as it is
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=40)
    out = llm_pp2.generate({"prompt_token_ids": long}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-40:] and out.outputs[0].token_ids == _ids(llm_pp2, long[-40:])
    short = llm_pp2.generate({"prompt_token_ids": long[:10]}, params, use_tqdm=False)[0]
    assert short.prompt_token_ids == long[:10]  # shorter prompts are left whole


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"), (dict(n=0), "n"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=5e-324), "repetition_penalty"), (dict(repetition_penalty=1e9), "repetition_penalty"),
    (dict(top_k=2 ** 108), "top_k"),  # found by the fuzz: too big for the sampler's int64
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"), (dict(bad_words="word"), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(temperature="0.5"), "temperature"), (dict(top_p=None), "top_p"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    # types the stages check as well: a value passed here and refused there would end the pipeline
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
    (dict(skip_special_tokens=None), "skip_special_tokens"), (dict(n=True), "n"), (dict(seed=True), "seed"),
    (dict(logprobs=True), "logprobs"), (dict(top_p=True), "top_p"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(temperature=float("inf")), "temperature"),
    (dict(seed=2 ** 63), "seed"), (dict(seed=-1), "seed"),  # 2**63 would be seed 0's draws
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_numpy_integers_are_integers_and_json_object_a_bool():
    params = SamplingParams(n=np.int64(2), seed=np.int32(7), max_tokens=np.int64(3), top_k=np.int64(0))
    assert (type(params.n), params.seed, type(params.max_tokens), params.top_k) == (int, 7, int, -1)
    with pytest.raises(ValueError, match=r"structured_outputs\.json_object='yes': must be True or False"):
        StructuredOutputsParams(json_object="yes")


def test_bad_prompts_raise_and_the_engine_keeps_working(llm_pp2):
    before = _ids(llm_pp2, [5, 6, 7])
    limit = llm_pp2.engine.max_model_len
    with pytest.raises(ValueError, match=rf"has {limit} tokens, but max_model_len is {limit}"):
        llm_pp2.generate({"prompt_token_ids": [1] * limit}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm_pp2.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm_pp2.generate({"prompt_token_ids": []}, use_tqdm=False)
    for ids in ([10 ** 6], [True, 5], [5, 2.0]):  # a bool is no token id, though Python counts it an int
        with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 384\); these are not: "):
            llm_pp2.generate({"prompt_token_ids": ids}, use_tqdm=False)
    assert _ids(llm_pp2, list(np.array([5, 6, 7]))) == before  # numpy's integers are
    for params, why in ((SamplingParams(stop_token_ids=[384]), r"stop_token_ids has token ids outside \[0, 384\)"),
                        (SamplingParams(prompt_logprobs=385), "prompt_logprobs=385 asks for more than the "
                                                              "vocabulary's 384 tokens")):
        with pytest.raises(ValueError, match=why):
            llm_pp2.generate("a", params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside \[0, 384\): \[384\]"):
        llm_pp2.generate("a", SamplingParams(logit_bias={384: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"allowed_token_ids has token ids outside \[0, 384\): \[400\]"):
        llm_pp2.generate("a", SamplingParams(allowed_token_ids=[5, 400]), use_tqdm=False)
    with pytest.raises(ValueError, match="must be a string"):
        llm_pp2.generate([123], use_tqdm=False)
    with pytest.raises(ValueError, match=r"pipellm runs text models and takes no \['text'\]"):
        llm_pp2.generate({"text": "hi"}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"a prompt dict needs 'prompt_token_ids' .* this one has \['prompt'\]"):
        llm_pp2.generate({"prompt": 5}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"takes no \['multi_modal_data'\]"):
        llm_pp2.generate({"prompt": "a", "multi_modal_data": {"image": None}}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, not dict"):
        list(llm_pp2.stream("a", {"max_tokens": 2}))
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm_pp2.generate("a", [GREEDY, GREEDY], use_tqdm=False)
    # A bad prompt in a batch queues nothing: the good one is not half-run.
    with pytest.raises(ValueError):
        llm_pp2.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm_pp2.engine.has_unfinished_requests()
    assert _ids(llm_pp2, [5, 6, 7]) == before
    assert llm_pp2.engine.block_manager.num_free_blocks == llm_pp2.engine.num_blocks


def test_output_is_capped_by_max_model_len(llama_dir):
    with LLM(llama_dir, max_model_len=12) as llm:
        out = llm.generate({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=50, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=6), "greater than the model's 5 layers"),
    (dict(pipeline_parallel_size=2, layer_partition=[2, 2]), "sums to 4, but the model has 5 layers"),
    (dict(pipeline_parallel_size=2, layer_partition=[5, 0]), "every stage needs at least one layer"),
    (dict(pipeline_parallel_size=3, layer_partition=[2, 3]), "has 2 entries but pipeline_parallel_size=3"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size=0"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(max_model_len=100000), "exceeds the model's context of 256"),
    (dict(num_scheduler_steps=0), "num_scheduler_steps=0: must be an integer from 1 to 1024"),
    (dict(num_scheduler_steps=1025), "num_scheduler_steps=1025: must be an integer from 1 to 1024"),
    (dict(seed="x"), r"seed='x': must be an integer in \[0, 2\*\*63\), or None for a random one"),
    (dict(kv_cache_gib=math.inf), "kv_cache_gib=inf: must be a number of GiB > 0, or None"),
    (dict(kv_cache_gib="1"), "kv_cache_gib='1': must be a number of GiB > 0"),
    (dict(layer_partition=5), "layer_partition=5: must be layer counts per stage"),
    (dict(trace_dir=123), "trace_dir=123: must be a folder's path"),
    (dict(step_timeout_s=-1), "step_timeout_s=-1: must be a number > 0"),
    (dict(auto_partition_prompt_ratio=-1), "auto_partition_prompt_ratio=-1: must be a number >= 0"),
])
def test_bad_engine_arguments(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, **kwargs)


def test_seed_none_is_a_random_engine_seed_and_a_shut_down_llm_says_so(llama_dir):
    drawn = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(llama_dir, dtype=FP32, seed=None) as llm:
            outs.append(_ids(llm, [5, 6, 7], drawn))
    assert outs[0] != outs[1]  # each engine drew its own seed
    for call in (lambda: llm.generate("a", use_tqdm=False), lambda: list(llm.stream("a")),
                 lambda: llm.describe_stages(), lambda: llm.chat([{"role": "user", "content": "a"}])):
        with pytest.raises(RuntimeError, match="this LLM was shut down; create a new LLM"):
            call()


def test_kv_caches_past_the_hosts_memory_are_refused_with_a_size_that_fits(llama_dir, monkeypatch):
    monkeypatch.setattr(device, "host_memory_available", lambda: 8 << 20)  # 8 MiB
    # each of the 5 layers' caches: 2048 blocks of 16 tokens, K and V, 2 KV heads of 16 values in fp32 = 8 MiB
    refused = (r"num_kv_blocks=2048: the KV caches of this host's 2 stage\(s\) would take 0.039 GiB, more than 90% "
               r"of the 0.008 GiB.*give num_kv_blocks=\d+ or fewer")
    with pytest.raises(ValueError, match=refused) as e:
        LLM(llama_dir, pipeline_parallel_size=2, num_kv_blocks=2048, dtype="float32")
    blocks = int(re.search(r"num_kv_blocks=(\d+) or fewer", str(e.value)).group(1))
    with LLM(llama_dir, pipeline_parallel_size=2, num_kv_blocks=blocks, dtype="float32") as llm:
        assert sum(r.kv_cache_bytes for r in llm.engine.inspect()) <= 8 << 20


def test_host_memory_available_is_within_the_hosts_memory():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < device.host_memory_available() <= total


def test_more_threads_than_cores_warns_with_a_count_that_fits(caplog):
    from pipellm.config import EngineConfig
    from pipellm.engine.engine import warn_if_oversubscribed

    cores = len(os.sched_getaffinity(0))
    for kwargs, fix in [(dict(threads_per_stage=cores + 1), f"threads_per_stage={cores} or fewer"),
                        (dict(pipeline_parallel_size=cores + 1), f"at most {cores} stage(s) a host")]:
        caplog.clear()
        warn_if_oversubscribed(EngineConfig(model="m", **kwargs))
        assert fix in caplog.text
    caplog.clear()
    warn_if_oversubscribed(EngineConfig(model="m", threads_per_stage=cores))  # what fits: quiet
    warn_if_oversubscribed(EngineConfig(model="m", pipeline_parallel_size=2, nnodes=2, master_port=29500,
                                         threads_per_stage=cores))
    assert caplog.text == ""


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2: pipellm splits a model by layers, into pipeline stages: "
                                   "give pipeline_parallel_size \\(-pp\\) instead"),
    (dict(tokenizer="other"), "tokenizer='other': pipellm reads the tokenizer from the model's folder"),
    (dict(revision="main"), "revision='main': pipellm loads local folders and GGUF files, with no hub download"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False: pipellm always runs a prompt in chunks"),
    (dict(trust_remote_code="yes"), "trust_remote_code='yes': give True or False"),
    (dict(max_num_seq=4), "LLM has no option 'max_num_seq'; did you mean max_num_seqs\\?"),
    (dict(kv_cache_gib=1.0, kv_cache_memory_bytes=2 ** 30), "give kv_cache_gib or kv_cache_memory_bytes, not both"),
])
def test_options_of_vllm_that_pipellm_lacks_say_what_to_give(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, **kwargs)


def test_options_of_vllm_that_ask_for_what_pipellm_does_are_taken(llama_dir, llm_pp2):
    with LLM(llama_dir, dtype=FP32, distributed_executor_backend="uni", tensor_parallel_size=1,
             trust_remote_code=True, enable_chunked_prefill=True, kv_cache_memory_bytes=2 ** 24) as llm:
        assert llm.engine.config.kv_cache_gib == 2 ** 24 / 2 ** 30
        assert _ids(llm, [5, 6, 7]) == _ids(llm_pp2, [5, 6, 7])


def test_processors_keep_their_state_through_preemption(llama_dir, llm_pp2):
    """A request preempted and recomputed picks as it does alone: its penalties' counts, min_tokens' count and its
    grammar's state carry over the recompute."""
    greedy = dict(max_tokens=24, temperature=0.0)
    params = [SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(**greedy, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(**greedy, ignore_eos=True, min_tokens=20, logit_bias={5: 3.0}),
              SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*"))]
    prompts = [[(11 * i + 7 * j + 3) % 384 for i in range(20)] for j in range(len(params))]
    alone = [_ids(llm_pp2, p, sp) for p, sp in zip(prompts, params)]
    # 14 blocks of 4 tokens hold one request of 44 tokens, not four: they take turns, preempted and recomputed
    with LLM(llama_dir, dtype=FP32, block_size=4, num_kv_blocks=14, max_model_len=48) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
