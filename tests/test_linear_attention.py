"""Qwen3-Next's and Qwen3.5's linear-attention layers: the delta rule against HF's token-by-token recurrence, and
each sequence's state kept apart from the others' through what the engine does to sequences (rows reused by later
requests, preemption and recompute, several decode steps a batch)."""
from types import SimpleNamespace

import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.loader.safetensors import load_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models.linear_attention import (LinearState, StateMixer, delta_rule_chunked, delta_rule_step, l2_normed,
                                             ssd_chunked, ssd_step)
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers
from tests.test_families import hf_greedy, make_family_checkpoint


def hf_recurrence(q, k, v, g, beta, state):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    out, state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=state[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_delta_rule_matches_the_recurrence(length):
    """A prompt's tokens at once (chunks of 64, the last padded), from a state left by earlier tokens, equal HF's
    recurrence token by token: outputs and the state after; so do decode steps, several sequences at once."""
    torch.manual_seed(length)
    hk, hv, dk, dv = 2, 4, 8, 6
    q, k = torch.randn(length, hk, dk), torch.randn(length, hk, dk)
    v, g, beta = torch.randn(length, hv, dv), -torch.rand(length, hv), torch.rand(length, hv)
    state = torch.randn(hv, dk, dv)
    ref_out, ref_state = hf_recurrence(q, k, v, g, beta, state)
    qs, ks = (l2_normed(t).repeat_interleave(hv // hk, 1) for t in (q, k))                 # [L, Hv, Dk]
    out, after = delta_rule_chunked(qs * dk ** -0.5, ks, v, g, beta, state.clone())
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, ref_state, atol=1e-5, rtol=1e-5)
    # the same tokens as decode steps of `length` sequences, each from the state given
    after = state.repeat(length, 1, 1, 1)
    out = delta_rule_step(qs * dk ** -0.5, ks, v, g, beta, after)
    for i in range(length):
        ref_out, ref_state = hf_recurrence(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state)
        torch.testing.assert_close(out[i], ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after[i], ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 63, 150])
def test_mamba2_scan_matches_hf(length):
    """Mamba-2's scan over a prompt (64-token chunks) from a given state equals HF's chunked scan (its 256-token
    chunks), outputs and final state; a decode step of each sequence equals HF's state update."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (mamba2_chunk_scan,
                                                                               mamba2_selective_state_update)
    torch.manual_seed(length)
    heads, head_dim, groups, width = 4, 6, 2, 5
    x, dt_raw = torch.randn(length, heads, head_dim), torch.randn(length, heads)
    B, C, A = torch.randn(length, groups, width), torch.randn(length, groups, width), -torch.rand(heads) * 2
    dt_bias, D, state = torch.randn(heads), torch.randn(heads), torch.randn(heads, head_dim, width)
    ref_out, ref_state = mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=256, D=D,
                                           dt_bias=dt_bias, dt_softplus=True, initial_states=state[None],
                                           return_final_states=True)
    dt = torch.nn.functional.softplus(dt_raw + dt_bias)
    per_head = [t.repeat_interleave(heads // groups, 1) for t in (B, C)]                 # [L, H, N]
    out, after = ssd_chunked(x, dt, A, *per_head, state.clone())
    torch.testing.assert_close(out + x * D[:, None], ref_out[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref_state[0], atol=1e-4, rtol=1e-4)
    states = state.repeat(length, 1, 1, 1)
    out = ssd_step(x, dt, A, *per_head, states)
    ref_states = state.repeat(length, 1, 1, 1)  # HF's arguments per head's row, as its layer passes them
    ref_out = mamba2_selective_state_update(
        ref_states, x, dt_raw[..., None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, width), B,
        C, D[:, None].expand(-1, head_dim), dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
    torch.testing.assert_close(out + x * D[:, None], ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def state_models(tmp_path_factory):
    """name -> (folder, prompts, HF's greedy ids, HF's model), each built on first use."""
    built = {}

    def get(name):
        if name not in built:
            folder = str(tmp_path_factory.mktemp(name))
            model = make_family_checkpoint(name, folder)
            prompts = [[(7 * i + 5 * j + 3) % 384 for i in range(12 + 5 * j)] for j in range(6)]  # 12 to 37 tokens
            built[name] = folder, prompts, [ids for ids, _ in hf_greedy(model, prompts)], model
        return built[name]
    return get


@pytest.fixture
def qwen3_5(state_models):
    return state_models("qwen3_5")


# requests that end at different steps: those still running keep rows out of their order in the batch
LENGTHS = [16, 6, 16, 9, 16, 10]


# more requests than run at once: later ones take the rows (and states) of finished ones; the KV blocks of the
# full-attention layers hold one request at a time: the others are preempted and recompute from zeros
REUSED = dict(max_num_seqs=2, block_size=4, num_kv_blocks=12, max_model_len=48)
AUTO = dict(pipeline_parallel_size=3, layer_partition="auto")  # split by each kind of layer's time


@pytest.mark.parametrize("name,options", [
    ("qwen3_5", REUSED),
    ("qwen3_5", dict(num_scheduler_steps=4)),  # several decode steps a batch
    ("qwen3_5", dict(pipeline_parallel_size=2, max_num_batched_tokens=8)),  # 8-token chunks, the state between them
    ("qwen3_5", AUTO),
    ("nemotron_h", REUSED),  # Nemotron-H's MLP and experts layers: no cache, no blocks
    ("nemotron_h", AUTO),
    ("falcon_h1", REUSED),  # Falcon-H1's layers: a KV cache and a state each
    ("falcon_h1", dict(pipeline_parallel_size=2, max_num_batched_tokens=8)),
    ("jamba", REUSED),  # Jamba's Mamba layers: a state [width, state width] a sequence
    ("jamba", dict(pipeline_parallel_size=2, max_num_batched_tokens=8, num_scheduler_steps=4)),
    ("lfm2", REUSED),  # LFM2's conv layers: the last 2 inputs a sequence, no matrices
    ("lfm2", dict(pipeline_parallel_size=2, max_num_batched_tokens=8, num_scheduler_steps=4)),
], ids=["rows-reused-preempted", "multi-step", "pp2-chunked", "pp3-auto", "nemotron_h-reused", "nemotron_h-pp3-auto",
        "falcon_h1-reused", "falcon_h1-pp2-chunked", "jamba-reused", "jamba-pp2-chunked-multi-step", "lfm2-reused",
        "lfm2-pp2-chunked-multi-step"])
def test_states_follow_their_sequences(state_models, name, options):
    folder, prompts, reference, _ = state_models(name)
    with LLM(folder, dtype="float32", **options) as llm:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if "num_kv_blocks" in options:
            assert llm.engine.scheduler.num_preemptions > 0
            assert llm.engine.block_manager.num_rows < len(prompts)  # rows were reused
    assert [o.outputs[0].token_ids for o in outputs] == [ids[:n] for ids, n in zip(reference, LENGTHS)]


def test_what_a_state_cannot_do_is_refused(qwen3_5):
    """Drafts would need the state to step back; inspect draws attention over KV caches: both say so."""
    folder, prompts, _, _ = qwen3_5
    with pytest.raises(ValueError, match=r"speculative_config: Qwen3_5ForCausalLM's linear-attention \(or Mamba\)"):
        LLM(folder, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with LLM(folder, dtype="float32") as llm:
        with pytest.raises(ValueError, match=r"linear-attention \(or Mamba\) layers hold a state"):
            llm.inspect({"prompt_token_ids": prompts[0]})


@pytest.mark.parametrize("options", [{}, dict(pipeline_parallel_size=2, max_num_batched_tokens=10)])
def test_a_requests_completions_go_on_from_the_states_the_first_saved(qwen3_5, options):
    """n=3 completions of one prompt: the first computes it and saves its states, the other two wait a step for them
    and run only the prompt's last tokens (its first 24 cached for each); all three go on as HF does."""
    folder, _, _, model = qwen3_5
    prompt = SYSTEM + [5, 9, 30, 41, 2, 77, 3, 8]  # 26 tokens: the state after 24 is saved
    (reply, _), = hf_greedy(model, [prompt])
    params = SamplingParams(n=3, max_tokens=len(reply), temperature=0.0, ignore_eos=True)
    with LLM(folder, dtype="float32", block_size=4, **options) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert llm.engine.block_manager.num_prefix_hits == 2 * 24
    assert [c.token_ids for c in out.outputs] == [reply] * 3


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "jamba", "lfm2"])
def test_a_state_is_saved_after_the_tokens_asked(state_models, name):
    """A mixer's state saved after its first k tokens of a step, for a prompt chunk cut there and for a chunk of one
    token, equals the state after those tokens run alone; and the step's outputs are those of the uncut chunk."""
    folder = state_models(name)[0]
    cfg = ModelConfig.from_pretrained(folder)
    model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True), meta=True)
    load_stage_weights(model, folder, torch.float32)
    mixer = next(m for m in model.modules() if isinstance(m, StateMixer))
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def run(state, start, n, saves=None):  # tokens start..start+n of one sequence in row 0, as one step
        meta = SimpleNamespace(state_rows=torch.tensor([0]), query_lens=torch.tensor([n]),
                               seq_lens=torch.tensor([start + n]), state_saves=saves)
        return mixer(x[start:start + n], meta, state)

    def fresh():
        return LinearState.allocate(cfg, torch.float32, rows=1)

    with torch.inference_mode():
        whole, cut = fresh(), fresh()
        expected = run(whole, 0, 9)
        out = torch.cat([run(cut, 0, 7, {0: [(1, 0), (4, 1), (7, 2)]}), run(cut, 7, 1, {0: [(1, 3)]}), run(cut, 8, 1)])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for slot, k in enumerate([1, 4, 7, 8]):
            alone = fresh()
            run(alone, 0, k)
            torch.testing.assert_close(cut.saved.conv[slot], alone.conv[0])
            torch.testing.assert_close(cut.saved.ssm[slot], alone.ssm[0], atol=1e-5, rtol=1e-5)


SYSTEM = [(11 * i + 2) % 384 for i in range(18)]  # a prompt head three requests share: 4 full blocks of 4 tokens


@pytest.mark.parametrize("name,options", [
    ("qwen3_5", {}),
    ("qwen3_5", dict(pipeline_parallel_size=2, max_num_batched_tokens=10)),  # states saved mid-chunk, on each stage
    ("nemotron_h", {}),
    ("falcon_h1", dict(pipeline_parallel_size=2, max_num_batched_tokens=8)),  # a KV cache and a state a layer
    ("jamba", {}),
    ("lfm2", dict(pipeline_parallel_size=2, max_num_batched_tokens=10)),
], ids=["qwen3_5", "qwen3_5-pp2-chunked", "nemotron_h", "falcon_h1-pp2-chunked", "jamba", "lfm2-pp2-chunked"])
def test_a_cached_prefix_goes_on_from_its_saved_state(state_models, name, options):
    """Requests one after another: a prompt, a second with the same head (it saves its state where the two part), a
    third with that head (it starts there), the first's conversation going on (it starts at the last full block of
    the first's reply), and the first again (it starts at its own last full block). Each starts after the tokens it
    should, and goes on as HF does from the whole prompt."""
    folder, _, _, model = state_models(name)
    first = SYSTEM + [5, 9, 30, 41, 2, 77, 3, 8]  # 26 tokens: its state after 24 is saved
    second, third = SYSTEM + [100, 1, 2, 3, 4, 5], SYSTEM + [200, 7, 6, 5, 4, 3, 2]
    (reply, _), = hf_greedy(model, [first])
    prompts = [first, second, third, first + reply + [60, 61, 62], first]
    reference = [ids for ids, _ in hf_greedy(model, prompts)]
    params = SamplingParams(max_tokens=len(reply), temperature=0.0, ignore_eos=True)
    with LLM(folder, dtype="float32", block_size=4, **options) as llm:
        bm, outputs, hits = llm.engine.block_manager, [], []
        for prompt in prompts:
            before = bm.num_prefix_hits
            outputs += llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            hits.append(bm.num_prefix_hits - before)
        assert llm.reset_prefix_cache()  # and after a reset, the first prompt again runs cold
        before = bm.num_prefix_hits
        again = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert bm.num_prefix_hits == before and again == reference[0]
    assert hits == [0, 0, 16, 40, 24]
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_qwen3_next_release_config():
    """Qwen3-Next-80B-A3B's config.json, without the keys it leaves at HF's defaults (layer_types, the partial
    rotary): read as HF reads it. Value heads that do not split evenly among key heads are refused."""
    from transformers import AutoConfig

    from pipellm.model_config import ModelConfig
    release = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", decoder_sparse_step=1,
                   full_attention_interval=4, head_dim=256, hidden_size=2048, intermediate_size=5120,
                   linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                   linear_num_value_heads=32, linear_value_head_dim=128, max_position_embeddings=262144,
                   mlp_only_layers=[], moe_intermediate_size=512, norm_topk_prob=True, num_attention_heads=16,
                   num_experts=512, num_experts_per_tok=10, num_hidden_layers=48, num_key_value_heads=2,
                   rms_norm_eps=1e-6, rope_theta=10000000, shared_expert_intermediate_size=512, vocab_size=151936)
    cfg = ModelConfig.from_hf_dict(release)
    hf = AutoConfig.for_model(**release)
    assert list(cfg.layer_types) == hf.layer_types and cfg.num_linear_layers == 36
    assert cfg.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert cfg.linear_attention == (16, 32, 128, 128, 4) and cfg.shared_expert_intermediate_size == 512
    with pytest.raises(ValueError, match="linear_num_value_heads=24 is not a multiple of its linear_num_key_heads=16"):
        ModelConfig.from_hf_dict(release | dict(linear_num_value_heads=24))


def test_nemotron_h_release_configs():
    """Nemotron Nano 9B v2's config.json (older keys: hybrid_override_pattern, Mamba-2 heads wider than hidden_size
    x expand) and Nemotron 3 Nano 30B-A3B's (experts layers), their pattern's letters as given: read as HF reads them.
    Nemotron 3 Super's latent experts read; what pipellm cannot run refused: a time step limit, unknown layers."""
    from transformers import AutoConfig

    from pipellm.model_config import ModelConfig
    nano2 = dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4480, head_dim=128,
                 hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
                 intermediate_size=15680, mamba_head_dim=80, mamba_num_heads=128, n_groups=8, num_attention_heads=40,
                 num_hidden_layers=56, num_key_value_heads=8, ssm_state_size=128, conv_kernel=4, expand=2,
                 max_position_embeddings=131072, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
                 time_step_limit=[0.0, float("inf")], vocab_size=131072, eos_token_id=12)
    nano3 = nano2 | dict(hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, mamba_num_heads=64,
                         mamba_head_dim=64,
                         n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                         moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                         norm_topk_prob=True, num_hidden_layers=52,
                         hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")
    for release in (nano2, nano3):
        cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
        assert list(cfg.layer_types) == hf.layers_block_type and cfg.num_layers == len(hf.layers_block_type)
        assert cfg.mamba == (hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.ssm_state_size, hf.conv_kernel)
        assert (cfg.head_dim, cfg.hidden_act, cfg.norm_eps) == \
            (hf.head_dim, hf.mlp_hidden_act, hf.layer_norm_epsilon)
        assert cfg.nope_layers == tuple(range(cfg.num_layers))
        moe = "moe" in hf.layers_block_type
        assert (cfg.num_experts, cfg.num_experts_per_tok) == ((hf.n_routed_experts, hf.num_experts_per_tok) if moe
                                                              else (0, 0))
        assert cfg.dense_layers == tuple(i for i, t in enumerate(hf.layers_block_type) if t != "moe")
        assert cfg.routed_scaling_factor == (hf.routed_scaling_factor if moe else 1.0)
        assert [cfg.has_kv_cache(i) for i in range(cfg.num_layers)] == \
            [t == "full_attention" for t in hf.layers_block_type]
    super_ = ModelConfig.from_hf_dict(nano3 | dict(moe_latent_size=1024))  # Nemotron 3 Super's experts
    assert super_.moe_latent_size == AutoConfig.for_model(**nano3 | dict(moe_latent_size=1024)).moe_latent_size
    for change, needle in [(dict(time_step_limit=[0.0, 0.1]), r"time_step_limit=\[0.0, 0.1\]"),
                           (dict(hybrid_override_pattern="M-X*"), r"layer types \['X'\] are not supported"),
                           (dict(n_groups=7), "64 Mamba-2 heads do not split into 7 groups")]:
        with pytest.raises(ValueError, match=needle):
            ModelConfig.from_hf_dict(nano3 | change)


def test_falcon_h1_release_config():
    """A config.json shaped as Falcon-H1-0.5B's (mamba_d_ssm not mamba_expand x hidden_size, head widths given,
    µP multipliers, no Mamba-2 norm): read as HF reads it."""
    from transformers import AutoConfig

    from pipellm.model_config import ModelConfig
    release = dict(architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", hidden_size=1024,
                   intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
                   mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_rms_norm=False,
                   mamba_norm_before_gate=False, rope_theta=1e11, vocab_size=32784, embedding_multiplier=5.657,
                   lm_head_multiplier=0.0390625, key_multiplier=0.390625, attention_out_multiplier=0.9375,
                   ssm_in_multiplier=1.25, ssm_out_multiplier=0.2357, ssm_multipliers=[0.354, 0.25, 0.354, 0.5, 0.354],
                   mlp_multipliers=[0.884, 0.586])
    cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
    assert cfg.mamba == (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv)
    assert cfg.mamba_norm == "none" and cfg.layer_types == ("hybrid",) * hf.num_hidden_layers
    assert cfg.mup_multipliers == (hf.attention_in_multiplier, hf.attention_out_multiplier, hf.ssm_in_multiplier,
                                   hf.ssm_out_multiplier, *hf.ssm_multipliers, *hf.mlp_multipliers)
    assert cfg.attention_multiplier == hf.key_multiplier * hf.head_dim ** -0.5
    assert cfg.logits_scaling == 1 / hf.lm_head_multiplier and cfg.embedding_multiplier == hf.embedding_multiplier
    assert all(cfg.is_linear(i) and cfg.has_kv_cache(i) for i in range(cfg.num_layers))
    with pytest.raises(ValueError, match="Mamba-2 heads of 24 x 60 for mamba_d_ssm=1536"):
        ModelConfig.from_hf_dict(release | dict(mamba_d_head=60))


def test_jamba_release_config():
    """Jamba Mini's config.json: every 8th layer attention (from layer 4), experts in every other (from layer 1), read
    as HF reads it; its state per sequence and Mamba layer: a [width, state width] fp32 matrix and the conv's last 3
    inputs."""
    from transformers import AutoConfig

    from pipellm.model_config import ModelConfig
    from pipellm.models.linear_attention import state_bytes
    release = dict(architectures=["JambaForCausalLM"], model_type="jamba", hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_experts=16,
                   num_experts_per_tok=2, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256,
                   vocab_size=65536, max_position_embeddings=262144)
    cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
    assert list(cfg.layer_types) == hf.layer_types and cfg.num_linear_layers == 28
    assert [cfg.num_experts if cfg.is_moe(i) else 1 for i in range(cfg.num_layers)] == hf.layers_num_experts
    assert cfg.mamba1 == (hf.mamba_expand * hf.hidden_size, hf.mamba_d_state, hf.mamba_d_conv, hf.mamba_dt_rank)
    assert state_bytes(cfg, torch.bfloat16) == 8192 * 16 * 4 + 8192 * 3 * 2
    one = ModelConfig.from_hf_dict(release | dict(num_experts=1))  # one expert: HF's layers all dense
    assert not any(one.is_moe(i) for i in range(one.num_layers)) and set(
        AutoConfig.for_model(**release | dict(num_experts=1)).layers_num_experts) == {1}
    with pytest.raises(ValueError, match="Jamba's hidden_act='gelu' is not supported"):
        ModelConfig.from_hf_dict(release | dict(hidden_act="gelu"))


def test_lfm2_release_config():
    """LFM2-1.2B's config.json (block_ff_dim, not intermediate_size; attention in full_attn_idxs only): its MLP width
    and layers read as HF builds them; its state per sequence and conv layer: the conv's last 2 inputs, no matrices."""
    from transformers import AutoConfig, Lfm2ForCausalLM

    from pipellm.model_config import ModelConfig
    from pipellm.models.linear_attention import state_bytes
    release = dict(architectures=["Lfm2ForCausalLM"], model_type="lfm2", hidden_size=2048, block_ff_dim=12288,
                   block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
                   conv_L_cache=3, conv_bias=False, full_attn_idxs=[2, 5, 8, 10, 12, 14], num_attention_heads=32,
                   num_key_value_heads=8, num_hidden_layers=16, norm_eps=1e-5, rope_theta=1000000.0,
                   max_position_embeddings=128000, vocab_size=65536, tie_embedding=True)
    cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
    with torch.device("meta"):
        model = Lfm2ForCausalLM(hf)
    assert cfg.intermediate_size == model.model.layers[0].feed_forward.w1.out_features == 8192
    assert [t == "full_attention" for t in cfg.layer_types] == [t == "full_attention" for t in hf.layer_types]
    assert cfg.num_linear_layers == 10 and cfg.short_conv == 3 and cfg.tie_word_embeddings
    assert cfg.rope.theta == 1000000.0 and cfg.norm_eps == 1e-5 and cfg.qk_norm
    assert state_bytes(cfg, torch.bfloat16) == 2048 * 2 * 2
    odd = ModelConfig.from_hf_dict(release | dict(block_ffn_dim_multiplier=1.3, block_multiple_of=100))
    assert odd.intermediate_size == Lfm2ForCausalLM(AutoConfig.for_model(
        **release | dict(block_ffn_dim_multiplier=1.3, block_multiple_of=100, num_hidden_layers=1,
                         full_attn_idxs=[0], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=16))).model.layers[0].feed_forward.w1.out_features


def test_lfm2_moe_release_config():
    """LFM2-8B-A1B's config.json: its first 2 layers' MLPs dense and intermediate_size wide (not adjusted), experts
    in the others behind a sigmoid router with a selection bias, read as HF builds them."""
    from transformers import AutoConfig, Lfm2MoeForCausalLM

    from pipellm.model_config import ModelConfig
    attention = [2, 6, 10, 14, 18, 21]
    release = dict(architectures=["Lfm2MoeForCausalLM"], model_type="lfm2_moe", hidden_size=2048,
                   intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=24, num_dense_layers=2,
                   num_experts=32, num_experts_per_tok=4, use_expert_bias=True, norm_topk_prob=True,
                   routed_scaling_factor=1.0, num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3,
                   layer_types=["full_attention" if i in attention else "conv" for i in range(24)], vocab_size=65536)
    cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
    with torch.device("meta"):
        model = Lfm2MoeForCausalLM(hf)
    moe = [hasattr(layer.feed_forward, "experts") for layer in model.model.layers]
    assert [cfg.is_moe(i) for i in range(cfg.num_layers)] == moe and moe.count(False) == 2
    assert cfg.intermediate_size == model.model.layers[0].feed_forward.w1.out_features == 7168
    assert cfg.moe_intermediate_size * 2 == model.model.layers[2].feed_forward.experts.gate_up_proj.shape[1]
    assert cfg.num_experts == 32 and cfg.num_experts_per_tok == 4 and cfg.router_sigmoid and \
        cfg.router_selection_bias and cfg.norm_topk_prob
    assert [cfg.is_linear(i) for i in range(24)] == [t == "conv" for t in hf.layer_types]


def test_bamba_release_config():
    """Bamba-9B's config.json (no rope_parameters; attention in attn_layer_indices): its layers, Mamba-2 shape and
    rotary on half of each head read as HF builds them."""
    from transformers import AutoConfig, BambaForCausalLM

    from pipellm.model_config import ModelConfig
    release = dict(architectures=["BambaForCausalLM"], model_type="bamba", attn_layer_indices=[9, 18, 27],
                   attn_rotary_emb=64, hidden_size=4096, intermediate_size=14336, mamba_conv_bias=True,
                   mamba_d_conv=4, mamba_d_head=64, mamba_d_state=128, mamba_expand=2, mamba_n_groups=1,
                   mamba_n_heads=128, mamba_proj_bias=False, max_position_embeddings=4096, num_attention_heads=32,
                   num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                   vocab_size=128256, tie_word_embeddings=False)
    cfg, hf = ModelConfig.from_hf_dict(release), AutoConfig.for_model(**release)
    with torch.device("meta"):
        model = BambaForCausalLM(hf)
    assert 2 * len(model.model.rotary_emb.inv_freq) == cfg.rope.partial_rotary_factor * cfg.head_dim == 64
    assert [cfg.is_linear(i) for i in range(cfg.num_layers)] == [t == "linear_attention" for t in hf.layers_block_type]
    assert cfg.mamba == (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv)
    assert cfg.embedding_multiplier == cfg.residual_multiplier == cfg.logits_scaling == 1.0
