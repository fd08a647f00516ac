"""Memory on 2 MB pages: the KV caches and a stage's weights. Each 4 KB page a read crosses costs a TLB entry, and
a decode step reads all of a stage's weights and its sequences' caches: the default model's one-call decode step ran
4-8% faster with its weights on 2 MB pages (BENCHMARKS.md)."""
import ctypes
import logging
import time

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux
PROBE_BYTES = 2 * HUGE_PAGE
_huge_pages = True                  # this process's memory goes on 2 MB pages, until they cost too much
_small_page_s: float | None = None  # measured on the first tensor that holds whole 2 MB pages
log = logging.getLogger("pipellm")
WEIGHTS_MIN_BYTES = 16 << 20  # a stage's weights below this stay where they are: few pages, little to gain
ARENA_BYTES = 256 << 20       # weights move an arena at a time: at most this much more memory while they move


def zeros_on_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory Linux is asked to back with 2 MB pages before it is first touched (where
    transparent huge pages are in "madvise" mode, the usual default), while they come cheap. Decode attention reads
    the cache in blocks scattered over it: with 4 KB pages each block costs TLB misses, and 8 sequences at 4,096
    tokens read 1.15x faster on 2 MB pages (BENCHMARKS.md). But once free 2 MB runs are used up, Linux compacts
    memory to fault in each one: a stage's start then zeroed its caches at 1.7-3.7 s a GB, against 0.2 on 4 KB
    pages. So each tensor's zeroing is timed against 4 KB pages' (measured once, on the first tensor), and from the
    first that takes more than twice as long, the process's memory stays on 4 KB pages."""
    global _huge_pages, _small_page_s
    t = torch.empty(shape, dtype=dtype)
    raw, base = t.view(-1).view(torch.uint8), t.data_ptr()
    start = -(-base // HUGE_PAGE) * HUGE_PAGE - base                   # byte offsets of whole 2 MB pages in t
    end = (base + t.nbytes) // HUGE_PAGE * HUGE_PAGE - base
    if end - start < PROBE_BYTES or not _huge_pages:
        return t.zero_()
    raw[:start].zero_()
    raw[end:].zero_()
    if _small_page_s is None:  # seconds to fault in and zero PROBE_BYTES on 4 KB pages
        _small_page_s = _timed_zero(raw[start:start + PROBE_BYTES])
        start += PROBE_BYTES
    if end > start:
        _advise_huge_pages(base + start, end - start)
        ratio = _timed_zero(raw[start:end]) / max(_small_page_s * (end - start) / PROBE_BYTES, 1e-9)
        if ratio > 2:
            _huge_pages = False
            log.info("weights and KV caches on 4 KB pages from here on: 2 MB pages took %.1fx the time to fault in",
                     ratio)
    return t


def _timed_zero(t: torch.Tensor) -> float:
    begin = time.perf_counter()
    t.zero_()
    return time.perf_counter() - begin


def _advise_huge_pages(address: int, length: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(address), ctypes.c_size_t(length),
                                                  MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    except (OSError, AttributeError):
        pass


def weights_on_huge_pages(model: nn.Module) -> int:
    """Moves model's CPU parameters and buffers into arenas on 2 MB pages (zeros_on_huge_pages, so not once those
    fault in slowly), storage by storage: tensors that share one (tied weights, views) still share it. Run it before
    anything holds a raw pointer into the weights (the kernels' Linear objects are built on first use). Returns the
    bytes moved."""
    storages: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors on it
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    total = sum(_padded(ts[0]) for ts in storages.values())
    if total < WEIGHTS_MIN_BYTES or not _huge_pages:
        return 0
    groups, size = [[]], 0  # the storages of each arena: up to ARENA_BYTES, or one storage past it
    for tensors in storages.values():
        if groups[-1] and size + _padded(tensors[0]) > ARENA_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(tensors)
        size += _padded(tensors[0])
    moved = 0
    for group in groups:
        if not _huge_pages:  # the last arena faulted in slowly: the rest stays where it is
            break
        moved += _move(group)
    _trim_heap()
    return moved


def _trim_heap() -> None:
    """Returns the heap's free memory to the OS (glibc): the weights' old homes, else counted as resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _padded(t: torch.Tensor) -> int:  # bytes of t's storage rounded up to a 64-byte line
    return -(-t.untyped_storage().nbytes() // 64) * 64


def _move(group: list[list[torch.Tensor]]) -> int:
    """The group's storages into one arena, in order; returns the arena's bytes."""
    arena = zeros_on_huge_pages((sum(_padded(ts[0]) for ts in group),), torch.uint8)
    offset = 0
    with torch.no_grad():
        for tensors in group:
            old, step = tensors[0].untyped_storage(), _padded(tensors[0])  # before set_ moves tensors[0]
            arena[offset:offset + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),)))
            for t in tensors:  # set_ changes the tensor in place: every module holding it sees the new memory
                t.set_(arena.untyped_storage(), offset // t.element_size() + t.storage_offset(), t.size(), t.stride())
            offset += step
    return offset
