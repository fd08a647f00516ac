"""Greedy picks from the LM head without every fp32 logit (CompactLinear.greedy: products of rounded rows in AMX
tiles, or in AVX512-VNNI's integer products for Q8 codes, then fp32 products of the candidates), against the argmax of
fp64 logits of the same weights, and in the engine against the full logits. Where the CPU has both, each unit test
runs on each (PIPELLM_ISA=amx, and avx512: no tiles)."""
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import dequantize as gguf_dequantize

from pipellm import LLM, SamplingParams, kernels
from pipellm.quant.gguf_blocks import repack
from pipellm.quant.linear import F32, GREEDY_INT8_MIN_ROWS, GREEDY_MIN_ROWS, Q8, CompactLinear, QuantWeight
from pipellm.quant.rtn import quantize
from tests.test_quant import ISAS, TYPES, gguf_tensor

# the first pass's instructions: AMX tiles (bf16, and int8 for Q8 codes), or without them AVX512-VNNI (Q8 codes only)
PATHS = [isa for isa in ("amx", "avx512") if isa in ISAS and (isa == "amx" or "avx512_vnni" in kernels.cpu_flags())]
pytestmark = pytest.mark.skipif(not PATHS, reason="the candidates come from AMX tiles or AVX512-VNNI, which this CPU "
                                "lacks")


@pytest.fixture(params=PATHS)
def isa(request, monkeypatch):
    monkeypatch.setenv("PIPELLM_ISA", request.param)  # read where a head first runs
    return request.param


def head_and_rows(n: int, k: int, rows: int, seed: int = 0, method: str = "int8"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (0.5 + torch.rand(n, 1, generator=gen))  # rows of different norms
    head = CompactLinear([quantize(w, method)])
    x = torch.randn(rows, k, generator=gen) * 3
    return head, x


def reference(head: CompactLinear, x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit, the products in fp64 of the weights as held."""
    return (x.double() @ head.parts[0].dequantize().double().t()).argmax(dim=1)


@pytest.mark.parametrize("method", ["int8", "int4"])  # codes times scales (int8 tiles up to 16 rows); plus mins
@pytest.mark.parametrize("rows", [GREEDY_INT8_MIN_ROWS, GREEDY_MIN_ROWS, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(5000, 128), (1003, 32)])  # a last group of 8 and 11 weight rows; one block
def test_greedy_equals_the_argmax_of_exact_logits(rows, method, n, k, isa):
    head, x = head_and_rows(n, k, rows, method=method)
    ids = head.greedy(x)
    int8_tiles = method == "int8" and isa == "amx"  # the one path that pays below GREEDY_MIN_ROWS
    if method == "int4" and isa != "amx" or rows < GREEDY_MIN_ROWS and not int8_tiles:
        assert ids is None  # no bf16 tiles without AMX, too few rows to gain: the caller computes the logits
        return
    assert ids is not None
    exact = x.double() @ head.parts[0].dequantize().double().t()
    top2 = exact.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs()  # fp32's own rounding cannot reorder these
    assert clear.sum() >= rows - 1
    assert torch.equal(ids[clear], reference(head, x)[clear])
    picked = exact.gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(picked, top2[:, 0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_gguf_type_picks_exactly_or_declines(qtype, isa):
    # Against the gguf package's own dequantization: the types whose weights the tiles round as the fp32 kernels
    # expand them pick the fp64 logits' largest; the others (bit planes with mins: Q5_1, Q5_K) leave it to the
    # full logits. Without AMX, only Q8_0 picks (its codes in integer products).
    n, k = 3000, 256
    raw = gguf_tensor(qtype, n, k)
    head = CompactLinear([repack(raw, qtype, n, k)])
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    ids = head.greedy(x)
    if not head.parts[0].expands_alike or isa != "amx" and qtype != T.Q8_0:
        assert ids is None
        return
    exact = x.double() @ torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k)).double().t()
    top2 = exact.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs()
    assert clear.sum() >= 15 and torch.equal(ids[clear], exact.argmax(dim=1)[clear])


def test_rows_bf16_cannot_tell_apart_get_their_fp32_order(isa):
    # Weight rows 10, 20 and 30 equal but for one code: their logits (~250) differ by ~0.04, far less than bf16
    # resolves there (~1) and far more than fp32 rounds (~1e-3 at worst), so the tiles' products tie them and the
    # fp32 products of the candidates order them.
    gen = torch.Generator().manual_seed(1)
    k = 64
    w = torch.randn(300, k, generator=gen) * 0.1
    base = torch.randn(k, generator=gen)
    base[5] = 0.5
    w[[10, 20, 30]] = base
    head = CompactLinear([quantize(w, "int8")])
    head.parts[0].codes[20, 5] += 1   # row 20 above rows 10 and 30 where x[5] > 0 ...
    x = base.repeat(GREEDY_MIN_ROWS, 1) * 4
    x[:, 5] = 2.0
    x[1, 5] = -2.0                    # ... and below them where it is not; 10 and 30 tie there: the first is the pick
    expected = [20, 10] + [20] * (GREEDY_MIN_ROWS - 2)
    assert reference(head, x).tolist() == expected
    assert head.greedy(x).tolist() == expected


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])  # GGUF's Q8_0, and fp32 scales
def test_rows_8_bit_rounding_reorders_get_their_fp32_order(isa, scale_dtype):
    # Q8 codes meet the rows rounded to 8 bits per 32 values (with AMX, up to 16 rows; scale d = max |x| / 127, set
    # here by x[0], which every weight row ignores): x[1] = 0.45 d rounds to 0 and x[2] = 0.55 d to d. Row 7 has 10
    # codes at 1, row 3 has 3 at 2, the others at most 2 at each: the rounded rows put row 3 first, the exact logits
    # row 7 (4.5 d s against 1.65 d s). The bound on the rounding keeps row 7 a candidate, and its fp32 product picks
    # it.
    gen = torch.Generator().manual_seed(4)
    n, k, s = 300, 64, 0.01
    codes = torch.randint(-20, 21, (n, k), generator=gen, dtype=torch.int8)
    codes[:, :3] = torch.randint(-2, 3, (n, 3), generator=gen, dtype=torch.int8)
    codes[:, 0] = 0
    codes[[3, 7], 1:3] = 0
    codes[7, 1], codes[3, 2] = 10, 3
    head = CompactLinear([QuantWeight(Q8, codes, torch.full((n, k // 32), s, dtype=scale_dtype), source="int8")])
    d = 1.27 / 127
    x = torch.zeros(GREEDY_MIN_ROWS, k)
    x[:, 0], x[:, 1], x[:, 2] = 1.27, 0.45 * d, 0.55 * d
    x_hat = x.clone()
    x_hat[:, 1], x_hat[:, 2] = 0.0, d
    w = head.parts[0].dequantize()
    assert (x_hat @ w.t()).argmax(dim=1).tolist() == [3] * GREEDY_MIN_ROWS
    assert reference(head, x).tolist() == [7] * GREEDY_MIN_ROWS
    assert head.greedy(x).tolist() == [7] * GREEDY_MIN_ROWS


def test_exact_ties_pick_the_first(isa):
    head, x = head_and_rows(1000, 64, GREEDY_MIN_ROWS, seed=2)
    q = head.parts[0]
    src = int(q.dequantize().norm(dim=1).argmax())
    for t in (q.codes, q.scale):
        t[[3, 700, 999]] = t[src].clone()
    x[:] = q.dequantize(torch.tensor([3]))[0] * 2  # the largest row, and its copies, the largest logit of every row
    first = min(3, src)
    assert reference(head, x).tolist() == [first] * GREEDY_MIN_ROWS
    assert head.greedy(x).tolist() == [first] * GREEDY_MIN_ROWS


def test_where_the_path_does_not_apply_the_caller_computes_logits(isa):
    head, x = head_and_rows(500, 64, 8)
    assert head.greedy(x[:GREEDY_INT8_MIN_ROWS - 1]) is None  # too few rows to gain
    assert (head.greedy(x[:GREEDY_MIN_ROWS - 1]) is None) == (isa != "amx")  # VNNI pays from more rows
    int4, _ = head_and_rows(500, 64, 8, method="int4")
    assert int4.greedy(x[:GREEDY_MIN_ROWS - 1]) is None  # the bf16 tiles need more
    assert (int4.greedy(x) is None) == (isa != "amx")  # and without AMX, they are not there
    bad = x.clone()
    bad[3, 7] = float("nan")
    assert head.greedy(bad) is None
    bad[3, 7] = float("inf")
    assert head.greedy(bad) is None
    dense = CompactLinear([QuantWeight(F32, torch.randn(500, 64))])
    assert dense.greedy(x) is None


def test_engine_tokens_equal_the_full_logits_path(smollm2_dir, monkeypatch):
    # The default model's LM head is Q8_0 (compact): its plain greedy rows take the candidates' path, and rows that
    # sample or ask for logprobs take their logits, in the same batch. Every token is what the full logits give.
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
               "In 1969, the first", "Water boils at"]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    others = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True, seed=7),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, ignore_eos=True, seed=8)]
    requests = prompts + prompts[:len(others)], [plain] * len(prompts) + others
    calls = []
    greedy = CompactLinear.greedy
    monkeypatch.setattr(CompactLinear, "greedy", lambda self, x: calls.append(len(x)) or greedy(self, x))
    with LLM(smollm2_dir, pipeline_parallel_size=1) as llm:  # its stage in this process
        fast = llm.generate(*requests, use_tqdm=False)
        assert calls and max(calls) == len(prompts)  # the plain greedy rows alone
        monkeypatch.setattr(CompactLinear, "greedy", lambda self, x: None)
        full = llm.generate(*requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
    assert fast[len(prompts)].outputs[0].token_ids == fast[0].outputs[0].token_ids  # its logits, prompt 0's pick
    assert fast[len(prompts)].outputs[0].logprobs is not None


def test_speculative_decoding_verifies_with_the_same_picks(smollm2_dir, monkeypatch):
    # n-gram drafts: every request's rows (its drafts, then its own) are greedy picks, through the tiles where each
    # request is plain greedy; the tokens are those of the full logits.
    prompts = ["1, 2, 3, 4, 5, 6, 7,", "a b c a b c a b", "The capital of France is", "def f(x): return x",
               "red green blue red green blue"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    calls = []
    greedy = CompactLinear.greedy
    monkeypatch.setattr(CompactLinear, "greedy", lambda self, x: calls.append(len(x)) or greedy(self, x))
    with LLM(smollm2_dir, pipeline_parallel_size=1, speculative_config=spec) as llm:
        fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert calls and max(calls) > len(prompts)  # drafts' rows too
        monkeypatch.setattr(CompactLinear, "greedy", lambda self, x: None)
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fast == full
