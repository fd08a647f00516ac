"""Memory on 2 MB pages: KV caches start zeroed whichever pages back them, and a stage's weights moved there keep
their values and their sharing, and the engine's greedy output stays HF's."""
import pytest
import torch
from torch import nn

from pipellm import LLM, SamplingParams
from pipellm.models import huge_pages
from pipellm.pipeline import worker
from tests.conftest import hf_greedy_ids

PROMPTS = [[(7 * i + 3) % 384 for i in range(40)], [5, 6, 7]]


def test_caches_start_zeroed_and_leave_2mb_pages_once_those_fault_in_slowly(monkeypatch):
    """A stage's caches start zeroed whichever pages back them; once 2 MB pages take more than twice as long as 4 KB
    ones to fault in (where Linux must first compact memory), later caches are no longer advised onto them."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(7))  # memory that held data
    monkeypatch.setattr(huge_pages, "_huge_pages", True)
    monkeypatch.setattr(huge_pages, "_small_page_s", None)
    advised = []
    monkeypatch.setattr(huge_pages, "_advise_huge_pages", lambda address, length: advised.append(length))
    shape = (5, 1 << 20)  # 20 MB of fp32: whole 2 MB pages, and parts of one at either end
    assert not huge_pages.zeros_on_huge_pages(shape, torch.float32).any()
    assert huge_pages._small_page_s is not None and len(advised) == 1  # 4 KB pages timed first, then the rest advised
    huge_pages._small_page_s = 1e-9  # as if 4 KB pages faulted in far faster than any 2 MB page here will
    assert not huge_pages.zeros_on_huge_pages(shape, torch.float32).any()
    assert len(advised) == 2 and not huge_pages._huge_pages
    assert not huge_pages.zeros_on_huge_pages(shape, torch.int8).any()
    assert len(advised) == 2  # from here on, 4 KB pages


def test_weights_move_with_their_values_and_sharing(monkeypatch):
    """Every parameter and buffer lands in an arena advised onto 2 MB pages, with its values; a tied weight stays one
    tensor for both modules, and a view stays a view of its base (a write through one shows in the other)."""
    monkeypatch.setattr(huge_pages, "_huge_pages", True)
    monkeypatch.setattr(huge_pages, "WEIGHTS_MIN_BYTES", 0)
    monkeypatch.setattr(huge_pages, "_small_page_s", 1.0)  # as if 4 KB pages were measured slow: no probe
    monkeypatch.setattr(huge_pages, "ARENA_BYTES", 20 << 20)  # two arenas
    advised = []
    monkeypatch.setattr(huge_pages, "_advise_huge_pages", lambda address, length: advised.append((address, length)))
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2048))
    model[0].weight = model[1].weight  # tied: one Parameter in two modules
    base = torch.arange(4096, dtype=torch.float32)
    model.register_buffer("base", base)
    model.register_buffer("tail", base[1000:])  # a view of the same storage
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    old_ptrs = {t.data_ptr() for t in before.values()}
    moved = huge_pages.weights_on_huge_pages(model)
    assert moved >= sum(t.nbytes for name, t in before.items() if name != "tail")
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    for name, t in tensors.items():
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() not in old_ptrs, name
    assert model[0].weight is model[1].weight
    assert model.tail.untyped_storage().data_ptr() == model.base.untyped_storage().data_ptr()
    model.base[1000] = -1.0
    assert model.tail[0].item() == -1.0
    assert len(advised) == 2  # an advice per arena, on its whole 2 MB pages
    assert all(length % huge_pages.HUGE_PAGE == 0 for _, length in advised)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_output_with_weights_on_2mb_pages(checkpoints, monkeypatch, quantization):
    """A one-stage pipeline (the stage in this process) with its weights moved before the kernels see them: greedy
    ids equal HF's in fp32, and equal those of the same engine with its weights left in place for compact int8."""
    folder, hf_model = checkpoints["llama"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    moved = []
    real = worker.weights_on_huge_pages
    monkeypatch.setattr(worker, "weights_on_huge_pages", lambda model: moved.append(real(model)))
    outputs = {}
    for min_bytes in (0, 1 << 62):  # moved, then left in place
        monkeypatch.setattr(huge_pages, "WEIGHTS_MIN_BYTES", min_bytes)
        monkeypatch.setattr(huge_pages, "_huge_pages", True)
        with LLM(folder, dtype="float32", quantization=quantization) as llm:
            out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outputs[min_bytes] = [o.outputs[0].token_ids for o in out]
    assert moved[0] > 0 and moved[1] == 0
    if quantization is None:
        assert outputs[0] == hf_greedy_ids(hf_model, PROMPTS, 12)
    assert outputs[0] == outputs[1 << 62]
