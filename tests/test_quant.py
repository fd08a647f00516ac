"""Compact weights: GGUF blocks repacked and multiplied by our kernels, against the `gguf` package's own
dequantization followed by an fp32 matmul."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pipellm import kernels
from pipellm.models import fused
from pipellm.quant.gguf_blocks import _BLOCK_BYTES, SUPPORTED, mapped_embedding, repack
from pipellm.quant import linear
from pipellm.quant.linear import (F32, FUSED_MAX_ROWS, Q4, Q8, CompactEmbedding, CompactLinear, QuantWeight, round_activations,
                                  set_int8_activations)
from tests.test_attention import KV_DTYPES, _run

ops = kernels.load()
ISAS = [isa for isa in ("generic", "avx2", "avx512", "amx")
        if isa == "generic" or (isa == "avx2" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
        or (isa == "avx512" and torch.backends.cpu.get_cpu_capability() == "AVX512")
        or (isa == "amx" and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and {"amx_tile", "amx_bf16", "avx512_bf16"} <= kernels.cpu_flags())]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)  # gguf cannot quantize these: their blocks are random bytes, valid scales
TYPES = [t for t in SUPPORTED if t != T.F32]


def gguf_tensor(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    size = _BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in ([208] if qtype == T.Q6_K else [0, 2]):  # the fp16 super-block scales: finite, small
        d = (rng.random((rows, cols // 256, 1)) * 0.01 + 1e-4).astype(np.float16)
        blocks[..., at:at + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def test_kernels_build_here():
    assert ops is not None, "the C++ kernels did not build; see the warning above"
    assert ops.best_isa() in ISAS


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repack_expands_to_gguf_dequantize_exactly(qtype):
    rows, cols = 19, 512  # ragged rows
    raw = gguf_tensor(qtype, rows, cols)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols))
    w = repack(raw, qtype, rows, cols, name="t")
    assert torch.equal(w.dequantize(), ref)  # the plain-torch twin
    for isa in ISAS:  # the kernel's own row expansion (the embedding lookup), in any order
        ids = torch.tensor([18, 0, 7, 7])
        assert torch.equal(ops.dequant_rows(*w._kernel_args(), ids, isa), ref[ids]), isa


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 2, 9, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 5, 100])
def test_matmul_matches_fp32_matmul_of_dequantized(qtype, num_rows):
    n, k = 37, 768 if qtype in K_QUANTS else 800  # 25 blocks of 32: the kernels' chunks of 8 blocks end ragged
    raw = gguf_tensor(qtype, n, k, seed=num_rows)
    w = repack(raw, qtype, n, k)
    ref_w = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ ref_w.t()
    tol = 1e-5 * (x.double().abs() @ ref_w.abs().t()).max().item()  # fp32 rounding of a k-term sum
    # integer codes can also multiply activations rounded to 8 bits: against gguf's own Q8_0 round trip of x
    x8 = gguf_q8_0_round_trip(x).double()
    for int8_acts, integer in ((False, 0), (True, 0), (True, 1 << 30)) if w.kind in (Q4, Q8) else ((False, 0),):
        for isa in ISAS:
            for fused_max in (0, 1 << 30):  # both the fused kernel and expand-then-torch.mm (or the integer one)
                y = ops.qlinear(x, *w._kernel_args(), fused_max, int8_acts, integer, isa)
                assert y.shape == (num_rows, n) and y.dtype == torch.float32
                expected = x8 @ ref_w.t() if int8_acts else ref
                assert (y.double() - expected).abs().max().item() <= tol, (isa, fused_max, int8_acts, integer)


@pytest.mark.skipif("avx512" not in ISAS, reason="the 16-lane path is in the AVX-512 build only")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fp32_rows_in_16_lanes_equal_the_dense_kernel_on_dequantized(qtype):
    """From XT_MIN_ROWS to XT_MAX_ROWS fp32 rows (AVX-512), each group of 8 (16 for up to 16 rows) weight rows is
    expanded once for all rows, which go transposed; each output sums in k order from zero, as the dense tiles do:
    the same bits as our dense kernel (checked against fp64 below) times gguf's dequantization, with 37 weight rows
    (groups end ragged), and a row's bits the same whatever rows are beside it. The stages' own row limit
    (FUSED_MAX_ROWS) routes them."""
    n, k = 37, 768 if qtype in K_QUANTS else 800
    raw = gguf_tensor(qtype, n, k, seed=5)
    w = repack(raw, qtype, n, k)
    dense = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).t().contiguous()   # [K, N]
    x = torch.randn(ops.XT_MAX_ROWS, k, generator=torch.Generator().manual_seed(2))
    for isa in (i for i in ISAS if i == "avx512" or (i == "amx" and not takes_amx_tiles(w))):
        dense_linear = ops.Linear.dense(dense, None, isa)
        # our dense kernel takes up to 64 rows (more go to sgemm): the reference in pieces of at most 64
        reference = torch.cat([dense_linear(part) for part in x.split(64)])
        alone = ops.qlinear(x[:ops.XT_MIN_ROWS], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, isa)
        for rows in (ops.XT_MIN_ROWS, 16, 21, 32, 40, ops.XT_MAX_ROWS):
            y = ops.qlinear(x[:rows], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, isa)
            assert torch.equal(y, reference[:rows]), (isa, rows)
            assert torch.equal(y[:ops.XT_MIN_ROWS], alone), (isa, rows)


def takes_amx_tiles(w: QuantWeight) -> bool:
    """fp32 rows from AMX_F32_MIN_ROWS on go through AMX tiles where the weights are Q4 or Q8 codes."""
    return w.kind in (Q4, Q8)


@pytest.mark.skipif("amx" not in ISAS, reason="AMX tiles: this CPU lacks them (or Linux did not grant them)")
@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in (T.F16, T.BF16)], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [37, 300])
def test_fp32_rows_through_amx_tiles(qtype, n):
    """AMX tiles multiply the codes (exact in bf16) by each fp32 row split into three bf16 parts, each group's
    scale and constant applied to its sums (Q6_K: groups of 16, a product each): within a few fp32 roundings of
    gguf's dequantization times x in fp64 (a two-part split, 16 bits of each value, gives 10-20x this error), and
    a row's bits the same whatever rows are beside it and however many threads share the columns. 37 or 300
    weight rows (a panel of 256 and 44) and 25 blocks end tiles, panels and chunks ragged; 100 rows end a group of
    16 ragged."""
    k = 768 if qtype in K_QUANTS else 800
    raw = gguf_tensor(qtype, n, k, seed=3)
    w = repack(raw, qtype, n, k)
    assert takes_amx_tiles(w)
    ref_w = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(4))
    ref, mag = x.double() @ ref_w.t(), x.double().abs() @ ref_w.abs().t()
    low = ops.AMX_F32_MIN_ROWS if w.group == 32 else ops.AMX_F32_MIN_ROWS_16  # the fewest rows the tiles take
    first = ops.qlinear(x[:low], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, "amx")
    threads = torch.get_num_threads()
    try:
        for rows in (low, 16, 17, 40, 100):
            ys = []
            for t in (1, 2):
                torch.set_num_threads(t)
                ys.append(ops.qlinear(x[:rows], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, "amx"))
            y = ys[0]
            assert ((y.double() - ref[:rows]).abs() <= 3e-7 * mag[:rows]).all(), rows
            assert torch.equal(ys[1], y), rows
            assert torch.equal(y[:low], first), rows
            tail = ops.qlinear(x[rows - low:rows], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, "amx")
            assert torch.equal(y[-low:], tail), rows
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_rows_match_bf16_matmul_of_dequantized(qtype):
    # dtype="bfloat16": up to FUSED_MAX_ROWS rows through the fp32 kernels, rounded to bf16 at the end; more rows
    # multiply weights rounded to bf16 with torch's bf16 matmul, as the dense bf16 weights would be multiplied. With
    # AMX, from AMX_MIN_ROWS rows on, our tiles multiply the weights rounded to bf16.
    n, k = 700, 768  # rows expanded 672 at a time: the last slice is ragged; 700 = 43 tiles of 16 and 12 rows
    raw = gguf_tensor(qtype, n, k)
    w = repack(raw, qtype, n, k)
    ref_w = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    for num_rows in (1, 2, ops.AMX_MIN_ROWS, 17, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 5, 100):
        x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
        for isa in ISAS:
            y = ops.qlinear(x, *w._kernel_args(), FUSED_MAX_ROWS, False, 0, isa)
            assert y.dtype == torch.bfloat16 and y.shape == (num_rows, n)
            by_oneDNN = num_rows > FUSED_MAX_ROWS and isa != "amx"
            rounded_w = by_oneDNN or (isa == "amx" and num_rows >= ops.AMX_MIN_ROWS)
            mag = x.double().abs() @ ref_w.double().abs().t()
            bound = 2 ** -7 * mag  # one bf16 rounding step
            if rounded_w and kernels.has_bf16_matmul():  # as the dense bf16 weights would give
                dense = x @ ref_w.bfloat16().t()
                if not by_oneDNN or "amx_bf16" in kernels.cpu_flags():  # AMX tiles: sums in another order
                    assert ((y.double() - dense.double()).abs() <= bound).all(), isa
                else:  # oneDNN's AVX512-BF16 kernels give any slice of columns the same bits
                    assert torch.equal(y, dense), isa
            # bf16 rounding of y, and of the weights where rounded
            tol = (2 ** -7 if rounded_w else 2 ** -8) * mag.max().item()
            assert (y.double() - x.double() @ ref_w.double().t()).abs().max().item() <= tol, isa
            if isa == "amx" and num_rows >= ops.AMX_MIN_ROWS:  # a row's result is the same beside any other rows
                alone = ops.qlinear(x[-ops.AMX_MIN_ROWS:], *w._kernel_args(), FUSED_MAX_ROWS, False, 0, isa)
                assert torch.equal(alone, y[-ops.AMX_MIN_ROWS:])


def gguf_q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the gguf package quantizes and dequantizes Q8_0."""
    x = x.float().numpy()
    return torch.from_numpy(dequantize(quantize(x, T.Q8_0), T.Q8_0).reshape(x.shape))


def test_activation_rounding_matches_gguf_q8_0():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 3, 256)
    x[1, :32] = 0  # an all-zero block
    x[3] = torch.arange(256) % 64 - 31.5  # with a maximum of 127 a block's scale is 1: halves, rounded away from 0
    x[3, ::32] = 127
    assert torch.equal(round_activations(x), gguf_q8_0_round_trip(x))


def test_unsupported_type_names_tensor_and_type():
    raw = np.zeros((4, 84), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"tensor blk\.3\.ffn_up\.weight has GGUF type Q2_K.*supported: F32"):
        repack(raw, T.Q2_K, 4, 256, name="blk.3.ffn_up.weight")


def test_kernel_refuses_bad_input():
    w = repack(gguf_tensor(T.Q8_0, 4, 64), T.Q8_0, 4, 64)
    with pytest.raises(RuntimeError, match=r"x must be fp32 or bf16 \[M, 64\]"):
        ops.qlinear(torch.randn(2, 32), *w._kernel_args(), 8, True, 1, "")
    with pytest.raises(RuntimeError, match=r"x must be fp32 or bf16 \[M, 64\]"):
        ops.qlinear(torch.randn(2, 64).half(), *w._kernel_args(), 8, True, 1, "")
    with pytest.raises(RuntimeError, match="row index out of range"):
        ops.dequant_rows(*w._kernel_args(), torch.tensor([4]), "")
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        ops.qlinear(torch.randn(2, 64), *w._kernel_args(), 8, True, 1, "sse9")
    with pytest.raises(RuntimeError, match=r"x must be fp32 or bf16 \[M, 64\]"):
        w.matmul_fn()(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match=r"bias must be fp32 \[4\]"):
        ops.Linear.concat([w.matmul_fn()], torch.zeros(5))
    f16 = repack(gguf_tensor(T.F16, 4, 64), T.F16, 4, 64)
    with pytest.raises(RuntimeError, match="8-bit activations need Q4 or Q8 weights"):
        ops.qlinear(torch.randn(2, 64), *f16._kernel_args(), 8, True, 1, "")
    # decode attention reads only blocks that exist, and no further than the block table reaches
    q, cache = torch.randn(1, 4, 16), torch.zeros(3, 4, 2, 16)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode_attention(q, cache, cache, None, None, torch.tensor([[0, 3]]), torch.tensor([5]), 0, 0.25, 0.0, "")
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        ops.paged_decode_attention(q, cache, cache, None, None, torch.tensor([[0, 1]]), torch.tensor([9]), 0, 0.25, 0.0, "")


def test_compact_linear_mixed_layouts_and_bias():
    # q, k and v of one layer in three formats, as Q4_K_M files mix them, plus a bias
    parts_raw = [(T.Q4_K, 8), (T.Q6_K, 4), (T.F32, 4)]
    parts, refs = [], []
    for i, (qtype, rows) in enumerate(parts_raw):
        if qtype == T.F32:
            dense = np.random.default_rng(i).standard_normal((rows, 256)).astype(np.float32)
            parts.append(QuantWeight(F32, torch.from_numpy(dense)))
            refs.append(torch.from_numpy(dense))
        else:
            raw = gguf_tensor(qtype, rows, 256, seed=i)
            parts.append(repack(raw, qtype, rows, 256))
            refs.append(torch.from_numpy(dequantize(raw, qtype).reshape(rows, 256)))
    bias = torch.randn(16)
    layer = CompactLinear(parts, bias)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(0))
    w = torch.cat(refs).double()
    expected = x.double() @ w.t() + bias.double()
    tol = 1e-5 * (x.double().abs() @ w.abs().t()).max().item()  # fp32 rounding of a 256-term sum
    assert (layer(x).double() - expected).abs().max().item() <= tol
    # the same rows and bias bound in one kernels' Linear, as the fused decode step holds them
    bound = fused._linear(ops, layer)
    assert torch.equal(bound(x.reshape(6, 256)), layer(x).reshape(6, 16))  # the same bits as CompactLinear's
    # int8_activations: the integer codes (Q4_K, Q6_K) multiply x rounded to 8 bits, the F32 rows x itself
    set_int8_activations(layer, True)
    x8 = gguf_q8_0_round_trip(x.reshape(6, 256)).reshape(x.shape)
    expected = torch.cat([x8.double() @ w[:12].t(), x.double() @ w[12:].t()], dim=-1) + bias.double()
    assert (layer(x).double() - expected).abs().max().item() <= tol
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_compact_linear_bf16_rows_by_cpu(monkeypatch):
    raw = gguf_tensor(T.Q4_1, 64, 256)
    w, ref = repack(raw, T.Q4_1, 64, 256), torch.from_numpy(dequantize(raw, T.Q4_1).reshape(64, 256))
    layer = CompactLinear([w])
    x = torch.randn(FUSED_MAX_ROWS + 8, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    try:
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
        linear.bf16_rows_to_kernels.cache_clear()
        dense = x @ ref.bfloat16().t()  # bf16 instructions: as dense bf16 weights (AMX tiles: to a rounding step)
        step = 2 ** -7 * (x.double().abs() @ ref.double().abs().t())
        assert ((layer(x).double() - dense.double()).abs() <= step).all()
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2"}))
        linear.bf16_rows_to_kernels.cache_clear()
        assert torch.equal(layer(x), w.matmul(x.float()).bfloat16())  # none: the fp32 kernels, as before
    finally:
        monkeypatch.undo()
        linear.bf16_rows_to_kernels.cache_clear()


def test_same_layouts_merge_into_one_matmul():
    a, b = (repack(gguf_tensor(T.Q4_1, 8, 64, seed=s), T.Q4_1, 8, 64) for s in (1, 2))
    c = repack(gguf_tensor(T.Q8_0, 8, 64), T.Q8_0, 8, 64)
    assert len(CompactLinear([a, b]).parts) == 1 and len(CompactLinear([a, c, b]).parts) == 3


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_round_to_nearest_levels_within_half_a_step(method):
    from pipellm.quant.rtn import ROWS, quantize

    rows = ROWS + 24  # two chunks of rows, the last ragged
    w = torch.randn(rows, 320, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 320)
    q = quantize(w, method)
    assert q.source == method and q.nbytes < w.nbytes / (3 if method == "int8" else 6)
    err = (q.dequantize() - w).abs().reshape(rows, 10, 32).amax(-1)               # [N, K/32]
    step = q.scale.float()
    # half a step, plus the fp16 rounding of the scale (and min) stretched over up to 127 levels
    assert (err <= 0.5 * step + 127 * step * 2 ** -11 + 1e-6).all()
    for isa in ISAS:  # and the kernel multiplies by exactly these levels
        x = torch.randn(3, 320)
        torch.testing.assert_close(ops.qlinear(x, *q._kernel_args(), 8, False, 0, isa), x @ q.dequantize().t(),
                                   rtol=1e-5, atol=1e-4)


def test_quantization_refusals(smollm2_dir):  # smollm2_dir: the converted default model, in a private cache
    from pipellm import LLM
    from pipellm.config import EngineConfig
    from pipellm.loader.default_model import default_model_path

    with pytest.raises(ValueError, match=r"quantization='fp8': must be \"int8\", \"int4\" or None"):
        EngineConfig(None, quantization="fp8")
    with pytest.raises(ValueError, match="a GGUF file's weights are quantized already"):
        LLM(default_model_path(), quantization="int8")


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_mapped_embedding_reads_rows_from_the_file(tmp_path, qtype):
    rows, cols = 19, 512
    raw = gguf_tensor(qtype, rows, cols)
    path = tmp_path / "t.gguf"
    path.write_bytes(b"x" * 96 + raw.tobytes())  # the table lies at an offset, as in a GGUF file
    emb = mapped_embedding(str(path), 96, raw.nbytes, qtype, rows, cols, torch.float32)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols))
    ids = torch.tensor([[18, 0], [7, 7]])
    assert torch.equal(emb(ids), ref[ids])
    assert torch.equal(emb(ids), CompactEmbedding(repack(raw, qtype, rows, cols), torch.float32)(ids))  # held
    assert torch.equal(emb.dequantize(), ref)  # what a GPU stage widens
    with pytest.raises(ValueError, match="do not hold 20 rows"):
        mapped_embedding(str(path), 96, raw.nbytes, qtype, rows + 1, cols, torch.float32)


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED if t != T.F32], ids=lambda t: t.name)
def test_held_within_115_percent_of_the_file(qtype):
    """MXFP4 aside: held in Q5_0's layout, its 4.25 bits a weight become 5.5 (the E2M1 values need 5-bit codes)."""
    raw = gguf_tensor(qtype, 16, 512)
    assert repack(raw, qtype, 16, 512).nbytes <= (5.5 / 4.25 if qtype == T.MXFP4 else 1.15) * raw.nbytes


@pytest.mark.parametrize("kv_dtype, atol", KV_DTYPES)
@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_kernel_at_model_head_sizes(monkeypatch, isa, dim, kv_dtype, atol):
    """Every instruction set's decode attention at real head sizes (its SIMD paths take multiples of 8 and 64), ragged
    contexts and windows, with and without sinks, against the dense reference."""
    class Forced:  # the kernels, with paged_decode_attention run by this instruction set
        def __getattr__(self, name):
            return getattr(ops, name)

        def paged_decode_attention(self, *args):
            return ops.paged_decode_attention(*args[:10], isa, *args[11:])

    forced = Forced()
    monkeypatch.setattr("pipellm.models.attention.kernels",
                        type("K", (), {"for_tensor": staticmethod(lambda x: forced)}))
    for window, sinks in ((None, None), (21, None), (None, torch.linspace(-1, 3, 6))):
        out, dense = _run([(3, 1), (40, 1), (0, 1), (17, 1)], 6, 2, window, seed=dim, kv_dtype=kv_dtype, dim=dim,
                          sinks=sinks)
        torch.testing.assert_close(out, dense, atol=atol, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_dense_few_rows_kernel_against_fp64_and_threads(isa):
    """Up to 64 fp32 rows times dense [K, N] weights (decode steps on an fp32 stage) through our kernels (a pass
    over the weights for up to 8 rows, register tiles for more): within fp32 rounding of an fp64 product, with a
    bias, at ragged sizes (K not a multiple of 8 or of the blocks' 32 and 64, N not of 16 or of the sweeps' 1024,
    rows not of the tiles' 8 or 4); a row's bits the same with 1 and 2 threads and beside any other rows. More rows
    take addmm, as TransposedLinear did."""
    from pipellm.models.layers import TransposedLinear

    gen = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    for k, n in ((576, 3072), (99, 37), (3, 5), (1536, 577), (65, 1100)):
        w, bias, x = torch.randn(k, n, generator=gen), torch.randn(n, generator=gen), torch.randn(65, k, generator=gen)
        expected = x.double() @ w.double() + bias.double()
        linear = ops.Linear.dense(w, bias, isa)
        for rows in (1, 3, 8, 9, 21, 64):
            ys = []
            for t in (1, 2):
                torch.set_num_threads(t)
                ys.append(linear(x[:rows]))
            torch.set_num_threads(threads)
            assert torch.equal(ys[0], ys[1])
            tol = 1e-6 * (x[:rows].double().abs() @ w.double().abs()).max().item()
            assert (ys[0].double() - expected[:rows]).abs().max().item() <= tol
            assert torch.equal(ys[0][:1], linear(x[:1]))  # a row's result does not depend on the rows beside it
            assert torch.equal(ys[0][-1:], linear(x[rows - 1:rows]))
        assert torch.equal(linear(x), torch.addmm(bias, x, w))
    nn_linear = torch.nn.Linear(k, n)
    layer = TransposedLinear(nn_linear)  # the layers' forward takes the same path as the fused step's Linear
    assert torch.equal(layer(x[:1]), ops.Linear.dense(layer.weight_t, layer.bias)(x[:1]))
    assert (layer(x[:1]).double() - nn_linear(x[:1]).double()).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantizes_as_transformers(dtype):
    """GPT-OSS's MXFP4 experts: equal to transformers' dequantizer, in chunks that split the blocks too."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pipellm.quant import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 4), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)                       # [3, 128, 40]
    assert torch.equal(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2), ref)
    assert torch.equal(mxfp4.dequantize(blocks, scales, dtype, chunk=7).transpose(1, 2), ref)
    with pytest.raises(ValueError, match=r"expected uint8 \[..., G, 16\]"):
        mxfp4.dequantize(blocks.float(), scales, dtype)


def test_mxfp4_kept_compact_exactly():
    """MXFP4 blocks held in Q5_0's layout: the very values transformers' dequantizer gives, multiplied by our kernels
    as the fp32 matmul of them; a scale with no fp16 form (2 ** -25) leaves the weight to the dense path."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pipellm.quant import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(104, 144, (40, 4), generator=gen, dtype=torch.uint8)               # every fp16 power
    ref = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()  # [40, 128]
    weight = mxfp4.quant_weight(blocks, scales)
    assert torch.equal(weight.dequantize(), ref)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 128, generator=gen)
        bound = (x.abs() @ ref.abs().t()) * 1e-5
        assert ((weight.matmul(x) - x @ ref.t()).abs() <= bound).all()
    assert mxfp4.quant_weight(blocks, torch.full_like(scales, 103)) is None
