"""lm-evaluation-harness against `pipellm serve -pp 2`, as a user runs it: its `local-completions` model (multiple
choice scored through echo + logprobs, and generate_until with a stop sequence) and its `local-chat-completions`
model, each compared item by item with lm-eval's own `hf` backend on the same tiny checkpoint. The tasks are local
files (tests/data/lm_eval), and nothing may reach the network."""
import ipaddress
import socket
from pathlib import Path

import accelerate  # noqa: F401  lm-eval's [hf] extra
import lm_eval  # plain imports: without lm-eval[api,hf] (the test extras) this file fails rather than skipping
import pytest
import tenacity  # noqa: F401  lm-eval's [api] extra
import torch
from lm_eval.tasks import TaskManager

from tests.serving import KEY, serve

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval"
MC, GEN = "pipellm_mc", "pipellm_gen"
NAME, MAX_MODEL_LEN = "tiny", 256
API_ARGS = dict(model=NAME, max_length=MAX_MODEL_LEN, num_concurrent=1, max_retries=1)  # a failure fails, no retry


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@pytest.fixture(scope="module")
def offline():
    """The hub switches off, and every connection off the loopback refused; yields the refused addresses."""
    refused, real_connect = [], socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            refused.append(address)
            raise OSError(f"this test must not reach the network: {address}")
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("OPENAI_API_KEY", KEY)  # lm-eval's local-* models send it as the bearer token
        mp.setattr(socket.socket, "connect", connect)
        yield refused


def _evaluate(model: str, model_args: dict, tasks: list[str], chat: bool = False) -> dict:
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, batch_size=1, log_samples=True, apply_chat_template=chat,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        random_seed=None, numpy_random_seed=None, torch_random_seed=None)  # leave the session's RNGs alone


def _samples(out: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in out["samples"][task]}


@pytest.fixture(scope="module")
def hf(llama_dir, offline):
    """The reference: lm-eval's transformers backend on the same folder, plain and through the chat template."""
    args = dict(pretrained=llama_dir, dtype="float32", device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide matmuls: a second thread only adds sync, and stalls on a busy machine
    try:
        return {"plain": _evaluate("hf", args, [MC, GEN]), "chat": _evaluate("hf", args, [GEN], chat=True)}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serve(llama_dir, tmp_path_factory.mktemp("lm-eval"), "--api-key", KEY, "--served-model-name", NAME,
               "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32") as s:
        yield s


def _same_generations(ours: dict, ref: dict) -> dict[int, str]:
    """Asserts the generate_until task gave the same text for every item and the same exact_match; returns ours."""
    gen, gen_ref = _samples(ours, GEN), _samples(ref, GEN)
    assert len(gen) == 6 and gen.keys() == gen_ref.keys()
    texts = {doc_id: s["filtered_resps"][0] for doc_id, s in gen.items()}
    assert texts == {doc_id: s["filtered_resps"][0] for doc_id, s in gen_ref.items()}
    assert ours["results"][GEN]["exact_match,none"] == ref["results"][GEN]["exact_match,none"]
    return texts


def test_local_completions_matches_hf(hf, server, offline, llama_dir):
    ours = _evaluate("local-completions", API_ARGS | dict(
        base_url=f"{server.url}/v1/completions", tokenizer=llama_dir, tokenizer_backend="huggingface",
        tokenized_requests=True), [MC, GEN])
    ref = hf["plain"]

    # multiple choice: the same accuracies, and per item the same log-likelihood (and is_greedy) for every choice
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == ref["results"][MC][metric], metric
    mc, mc_ref = _samples(ours, MC), _samples(ref, MC)
    assert len(mc) == 10 and mc.keys() == mc_ref.keys()
    for doc_id, sample in mc.items():
        assert sample["arguments"] == mc_ref[doc_id]["arguments"]  # the same (context, continuation) pairs
        scores, scores_ref = sample["filtered_resps"], mc_ref[doc_id]["filtered_resps"]
        assert [greedy for _, greedy in scores] == [greedy for _, greedy in scores_ref], doc_id
        assert [ll for ll, _ in scores] == pytest.approx([ll for ll, _ in scores_ref], abs=1e-3), doc_id

    # generate_until: greedy text equal item by item, cut where the stop sequence first comes
    texts = _same_generations(ours, ref)
    raw = {}
    for doc_id, sample in _samples(ours, GEN).items():
        context, gen_kwargs = sample["arguments"][0]
        raw[doc_id] = server.client().completions.create(model=NAME, prompt=context, temperature=0,
                                                         max_tokens=gen_kwargs["max_gen_toks"]).choices[0].text
        assert texts[doc_id] == raw[doc_id].split(gen_kwargs["until"][0])[0]
    assert sum("\n" in text for text in raw.values()) >= 2  # the data makes the stop sequence matter
    assert not offline


def test_local_chat_completions_matches_hf(hf, server, offline):
    ours = _evaluate("local-chat-completions", API_ARGS | dict(base_url=f"{server.url}/v1/chat/completions"), [GEN],
                     chat=True)  # lm-eval's chat models require the chat template
    _same_generations(ours, hf["chat"])
    assert not offline
