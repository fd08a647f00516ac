"""Tiny random checkpoints made with transformers, saved to temporary folders (no network)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # a GPU's Triton kernels run here in Triton's interpreter (test_attention.py); it
    # is read where triton wraps its kernels, its own helpers too: at its first import, before any test module's
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = ["The capital of France is Paris.", "Once upon a time, there was a little girl.",
          "Pipelines keep every stage busy while tokens flow from one stage to the next.",
          "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8 9 10", "Hello world! How are you today?"] * 4
CHAT_TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments }}{% endfor %}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB = 384
FP32 = "float32"  # the dtype of tests that compare two runs token for token (see llm_pp2)
NUM_LAYERS = 5


def save_tokenizer(folder: str) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=VOCAB - 8, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def hf_config(arch: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    # initializer_range 0.2 spreads the logits, so greedy choices are not near-ties.
    common = dict(vocab_size=VOCAB, initializer_range=0.2, eos_token_id=0, bos_token_id=0)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=NUM_LAYERS, n_head=4, n_positions=256, **common)
    llama_like = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, **common) | overrides
    if arch == "llama":
        return LlamaConfig(rope_theta=500000.0, tie_word_embeddings=False, **llama_like)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **llama_like)
    if arch == "mistral":
        return MistralConfig(sliding_window=24, head_dim=32, **llama_like)  # window shorter than the test prompts
    raise ValueError(arch)


def make_checkpoint(arch: str, folder: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), attn_implementation="eager").eval()
    if arch == "qwen2":  # random q/k/v biases, so loading them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


def hf_greedy_ids(model, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, one at a time (no padding), the model on device."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device=device), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def spy_chunks_ahead(llm) -> list[bool]:
    """Per batch the engine sends from now on: whether a request in it already had a batch out (a prompt's chunk
    sent ahead of the one before)."""
    seen, schedule = [], llm.engine.scheduler.schedule

    def spy(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        if batch is not None:
            seen.append(any(r.in_flight > 1 for r in batch.requests))
        return batch
    llm.engine.scheduler.schedule = spy
    return seen


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (folder, HF model). Built once per test session."""
    out = {}
    for arch in ARCHS:
        folder = str(tmp_path_factory.mktemp(arch))
        out[arch] = (folder, make_checkpoint(arch, folder))
    return out


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"][0]


@pytest.fixture(scope="session")
def llm_pp2(llama_dir):
    """One 2-stage engine on the tiny Llama, shared by tests that only read from it. float32 on every CPU, as the
    engines and servers compared with it (FP32): with bf16 activations (dtype="auto" where bf16 matmul is
    faster) a sequence's greedy tokens may move with the batch it runs in or a recomputed cache, and the random tiny
    models' top tokens are close enough to flip."""
    from pipellm import LLM

    with LLM(llama_dir, pipeline_parallel_size=2, dtype=FP32) as llm:
        yield llm


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default model, converted from its GGUF once per session into a private cache."""
    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import cached_gguf_folder

    cache = str(tmp_path_factory.mktemp("pipellm-cache"))
    old = os.environ.get("PIPELLM_CACHE_DIR")
    os.environ["PIPELLM_CACHE_DIR"] = cache  # LLM(model=None) finds the same converted folder
    yield cached_gguf_folder(default_model_path())
    if old is None:
        del os.environ["PIPELLM_CACHE_DIR"]
    else:
        os.environ["PIPELLM_CACHE_DIR"] = old
