"""The fused RMSNorm and rotary kernels against HF transformers' own Llama modules; the warning for bf16 without bf16."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pipellm import kernels
from pipellm.rope_config import RopeConfig
from pipellm.models.layers import RMSNorm
from pipellm.models.rotary import RotaryEmbedding, apply_rotary


def test_kernels_are_used():
    assert kernels.load() is not None


def _same_weight(ours, theirs):
    """Two norms of 576 given one random weight (seed 0, so what follows draws the same inputs each run)."""
    torch.manual_seed(0)
    w = torch.randn(576)
    ours.weight.data.copy_(w)
    theirs.weight.data.copy_(w)
    return ours, theirs


def test_rms_norm_matches_hf():
    ours, theirs = _same_weight(RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5))
    for rows in (1, 7):
        x = torch.randn(rows, 576) * 3
        with torch.inference_mode():
            torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(ours(x[:, None]), theirs(x[:, None]), rtol=2e-6, atol=1e-6)  # not 2-D: twin
    ours.bfloat16(), theirs.bfloat16()
    for rows in (1, 7, 300):  # bf16: rounded after normalising and after scaling, as HF rounds; at most a bf16 step
        x = (torch.randn(rows, 576) * 3).bfloat16()  # apart where the two sums of squares round 1/rms differently
        with torch.inference_mode():
            y, ref = ours(x), theirs(x)
        assert y.dtype == torch.bfloat16 and (y != ref).float().mean() < 0.01
        torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=0)


def test_gemma_rms_norm_matches_hf_in_bf16():
    # Gemma scales by 1 + w in fp32 and rounds once: not the Llama order of the kernel's bf16 rows
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from pipellm.models.layers import GemmaRMSNorm

    ours, theirs = _same_weight(GemmaRMSNorm(576, 1e-6), Gemma3RMSNorm(576, eps=1e-6))
    ours.bfloat16(), theirs.bfloat16()
    x = (torch.randn(7, 576) * 3).bfloat16()
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("family", ["olmo2", "gpt_oss"])
def test_fp32_scaled_rms_norm_matches_hf_in_bf16(family):
    """OLMo 2's and GPT-OSS's norms scale in fp32 and round once; Llama's order (RMSNorm) rounds before scaling too,
    which differs here."""
    import importlib

    from pipellm.models.layers import Fp32ScaledRMSNorm

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    theirs_class = getattr(module, "Olmo2RMSNorm" if family == "olmo2" else "GptOssRMSNorm")
    ours, theirs = _same_weight(Fp32ScaledRMSNorm(576, 1e-6), theirs_class(576, eps=1e-6))
    llama = _same_weight(RMSNorm(576, 1e-6), theirs_class(576, eps=1e-6))[0]
    for norm in (ours, theirs, llama):
        norm.bfloat16()
    x = (torch.randn(7, 576) * 3).bfloat16()
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(llama(x), theirs(x))


def test_rotary_matches_hf():
    torch.manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(), 64, 256)
    positions = torch.tensor([0, 5, 17, 255])
    cos, sin = rope.tables(positions, torch.float32)                                    # [T, 1, D]
    qkv = torch.randn(4, 9 * 64 + 2 * 3 * 64)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views, as in the model
    q, k = q.view(4, 9, 64), k.view(4, 3, 64)
    # HF: [batch, heads, T, D] with cos/sin [batch, T, D]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None], sin[:, 0][None])
    with torch.inference_mode():
        rq, rk = apply_rotary(q.clone(), k.clone(), cos, sin)
    assert torch.equal(rq, hq[0].transpose(0, 1)) and torch.equal(rk, hk[0].transpose(0, 1))
    # bf16 (HF's tables cast to bf16, each product and the sum rounded): the same bits
    cos, sin = rope.tables(positions, torch.bfloat16)
    q, k = qkv.bfloat16()[:, :9 * 64].view(4, 9, 64), qkv.bfloat16()[:, 9 * 64:12 * 64].view(4, 3, 64)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None], sin[:, 0][None])
    with torch.inference_mode():
        rq, rk = apply_rotary(q.clone(), k.clone(), cos, sin)
    assert rq.dtype == torch.bfloat16
    assert torch.equal(rq, hq[0].transpose(0, 1)) and torch.equal(rk, hk[0].transpose(0, 1))


def test_bf16_on_a_cpu_without_it_warns(monkeypatch, caplog):
    from pipellm.engine import engine

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    engine.warn_if_slow_dtype("bfloat16")
    assert "30-70x slower than float32; use dtype='float32'" in caplog.text
    caplog.clear()
    engine.warn_if_slow_dtype("float32")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    engine.warn_if_slow_dtype("bfloat16")
    assert caplog.text == ""
