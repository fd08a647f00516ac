"""Compact weights: one QuantWeight interface for every layout, and the linear and embedding modules built on it.

A QuantWeight is an [N, K] matrix (one output feature a row) kept in one of the layouts of kernels/qgemm.cpp.
`matmul` runs our C++ kernel; `dequantize` is its plain-torch twin, the reference the tests hold the kernel to and
the path taken where the kernel cannot be built.
"""
import functools

import numpy as np
import torch
from torch import nn

from pipellm import kernels

F16, BF16, Q4, Q8, F32 = 0, 1, 2, 3, 4  # kernels/qgemm.h's Kind, plus F32 (plain torch matmul)
KIND_NAMES = {F16: "F16", BF16: "BF16", Q4: "Q4", Q8: "Q8", F32: "F32"}
FUSED_MAX_ROWS = 32  # up to this many rows the fused kernel beats expanding a slice for torch's matmul (BENCHMARKS.md)
MAPPED = " file-mapped"  # weight_bytes' format suffix for an embedding read from the file as looked up
INTEGER_MAX_ROWS = 1  # int8_activations: rows multiplied in integers; more go through the fp32 paths, rounded
# rows from which CompactLinear.greedy beats the full logits: the tiles' cost is flat in the rows (the default model's
# LM head on one thread, ms, full / greedy: 3 rows 3.0 / 3.2, 4 3.4 / 3.4, 5 4.1 / 3.4, 16 6.6 / 3.4; BENCHMARKS.md);
# Q8 codes with a scale per 32 go to the int8 tiles unexpanded, which pay from 2 rows (1 row 1.35 / 1.99, 2 rows
# 2.44 / 2.00, 3 rows 2.99 / 2.03); without AMX, AVX512-VNNI's integer products pay from GREEDY_MIN_ROWS (AMD EPYC,
# one thread: 4 rows 3.41 / 3.41, 5 rows 3.86 / 3.46, 16 rows 10.8 / 3.7)
GREEDY_MIN_ROWS = 5
GREEDY_INT8_MIN_ROWS = 2


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to 8 bits per 32 values as GGUF's Q8_0 rounds them (d = max |x| / 127 kept as fp16, codes
    rounded half away from zero): what Q4 and Q8 weights multiply, as in llama.cpp. Plain torch, the kernel's twin."""
    b = x.float().reshape(x.shape[0], -1, 32)                                  # [M, K/32, 32]
    d = b.abs().amax(-1, keepdim=True) / 127
    t = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = t.abs()
    q = torch.copysign(a.floor() + (2 * (a - a.floor())).floor(), t)
    return (q * d.half().float()).reshape(x.shape)


class QuantWeight(nn.Module):
    """codes [N, K/2] (Q4, uint8), [N, K] (Q8 int8; F16/BF16/F32 floats); scale and min [N, K/group] or None:
    w = q * scale + min. Two-level (the K-quants): scale and min are uint8 multiples of fp16 super_scale and
    super_min [N, K/256], and w = q * (super_scale * scale) - super_min * min (Q6_K: int8 scales per 16, no min).
    Q4 codes of 5 or 6 bits (Q5_0, Q5_1, Q5_K, Q6_K) keep bits 4 and 5 in bit planes, high [N, planes * K/8] (per
    32 weights, a 4-byte run a plane, bit j for weight j), and q = nibble | plane0 << 4 | plane1 << 5 - offset."""

    def __init__(self, kind: int, codes: torch.Tensor, scale: torch.Tensor | None = None,
                 min: torch.Tensor | None = None, group: int = 32, source: str = "",
                 super_scale: torch.Tensor | None = None, super_min: torch.Tensor | None = None,
                 high: torch.Tensor | None = None, offset: int = 0):
        super().__init__()
        self.kind, self.group, self.source, self.offset = kind, group, source or KIND_NAMES[kind], offset
        self.int8_acts = False  # EngineConfig.int8_activations, for integer codes
        self.num_rows = codes.shape[0]
        self.num_cols = codes.shape[1] * (2 if kind == Q4 else 1)
        for name, t in (("codes", codes), ("scale", scale), ("min", min), ("super_scale", super_scale),
                        ("super_min", super_min), ("high", high)):
            self.register_buffer(name, None if t is None else t.contiguous())

    def _tensors(self) -> tuple:
        return self.codes, self.scale, self.min, self.super_scale, self.super_min, self.high

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors() if t is not None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [R, K] of the given rows (all by default), in plain torch."""
        codes = self.codes if rows is None else self.codes[rows]
        if self.kind in (F16, BF16, F32):
            return codes.float()
        n = codes.shape[0]
        if self.kind == Q4:
            # per 32 weights 16 bytes: low nibbles are weights 0-15, high nibbles 16-31
            b = codes.view(n, -1, 16)                                          # [n, K/32, 16]
            q = torch.cat((b & 15, b >> 4), dim=-1).float()                    # [n, K/32, 32]
            if self.high is not None:
                planes = (self.high if rows is None else self.high[rows]).view(n, -1, 4)  # [n, K/32 * planes, 4]
                bits = (planes[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1      # [.., 4, 8]: bit j%8
                bits = bits.reshape(n, q.shape[1], -1, 32).float()             # [n, K/32, planes, 32]
                for p in range(bits.shape[2]):
                    q = q + bits[:, :, p] * (16 << p)
                q = q - self.offset
        else:
            q = codes.float()
        q = q.reshape(n, -1, self.group)                                       # [n, K/group, group]
        pick = (lambda t: (t if rows is None else t[rows]).float())
        scale, mins = pick(self.scale), None if self.min is None else pick(self.min)
        if self.super_scale is not None:  # [n, K/256] -> one per group: [n, K/group]
            scale = pick(self.super_scale).repeat_interleave(256 // self.group, dim=-1) * scale
            if mins is not None:
                mins = -(pick(self.super_min).repeat_interleave(256 // self.group, dim=-1) * mins)
        w = q * scale[..., None]
        if mins is not None:
            w = w + mins[..., None]
        return w.reshape(n, self.num_cols)

    def _kernel_args(self):
        return (self.codes, self.scale, self.min, self.kind, self.group, self.super_scale, self.super_min, self.high,
                self.offset)

    @property
    def int8_activations(self) -> bool:
        """Whether activations are rounded to 8 bits (round_activations()) for this weight: integer codes only, when
        EngineConfig.int8_activations asks."""
        return self.int8_acts and self.kind in (Q4, Q8)

    def matmul_fn(self):
        """A function x [M, K] fp32 -> x @ W^T [M, N] fp32, with this weight's arguments checked and bound once (the
        kernels' Linear): a decode step makes ~120 of these calls on one row each, where attribute lookups cost more
        than the kernel (40 us a call against 6 us)."""
        ops = kernels.load()
        if ops is None:
            return lambda x: (round_activations(x) if self.int8_activations else x) @ self.dequantize().t()
        if self.kind == F32:
            return ops.Linear.dense(self.codes.t())
        return ops.Linear(*self._kernel_args(), FUSED_MAX_ROWS, self.int8_activations, INTEGER_MAX_ROWS, "")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> x @ W^T, [M, N] fp32."""
        return self.matmul_fn()(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows for ids [T] (an embedding lookup that expands only those rows)."""
        ops = kernels.load() if self.kind != F32 else None
        if ops is None:
            return self.dequantize(ids)
        return ops.dequant_rows(*self._kernel_args(), ids, "")

    @property
    def expands_alike(self) -> bool:
        """Whether the AMX tiles round to bf16 the very fp32 weights the other kernel paths expand, as the bounds of
        CompactLinear.greedy need: every layout but codes with both bit planes and mins (Q5_1, Q5_K), whose 16-lane
        expansion folds the planes' offset into the min with a rounding of its own."""
        return self.kind != F32 and (self.high is None or self.min is None)

    def bf16_error_norms(self, chunk: int = 4096) -> torch.Tensor:
        """fp32 [2, N]: each row's ||bf16(w)|| and ||w - bf16(w)||, rounded up (the kernels' greedy_pick bounds its
        bf16 products' errors with them)."""
        parts = []
        for start in range(0, self.num_rows, chunk):
            w = self.rows(torch.arange(start, min(start + chunk, self.num_rows)))                # [n, K]
            wb = w.bfloat16().float()
            # w - wb is exact in fp32 (a rounding's error), and the sums of squares are taken in fp64
            parts.append(torch.stack([torch.linalg.vector_norm(t, dim=1, dtype=torch.float64) for t in (wb, w - wb)]))
        norms = torch.cat(parts, dim=1)
        return torch.nextafter(norms.float(), torch.tensor(float("inf")))

    def same_layout(self, other: "QuantWeight") -> bool:
        return (self.kind, self.group, self.num_cols, self.offset) == (
            other.kind, other.group, other.num_cols, other.offset) and all(
            (a is None) == (b is None) and (a is None or a.dtype == b.dtype)
            for a, b in zip(self._tensors(), other._tensors()))

    def take_rows(self, index: torch.Tensor) -> "QuantWeight":
        codes, scale, mins, sup, sup_min, high = (None if t is None else t[index] for t in self._tensors())
        return QuantWeight(self.kind, codes, scale, mins, self.group, self.source, sup, sup_min, high, self.offset)

    @staticmethod
    def stack(parts: list["QuantWeight"]) -> "QuantWeight":
        """Rows of parts of one layout, one after another (q, k and v into one qkv matrix)."""
        columns = zip(*(p._tensors() for p in parts))
        codes, scale, mins, sup, sup_min, high = (None if ts[0] is None else torch.cat(ts) for ts in columns)
        source = "+".join(dict.fromkeys(p.source for p in parts))
        return QuantWeight(parts[0].kind, codes, scale, mins, parts[0].group, source, sup, sup_min, high,
                           parts[0].offset)


class CompactLinear(nn.Module):
    """y = x @ W^T + b, W in row blocks (each block one QuantWeight): q, k and v may arrive in different layouts."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        super().__init__()
        merged: list[QuantWeight] = []
        for p in parts:
            if merged and merged[-1].same_layout(p):
                merged[-1] = QuantWeight.stack([merged[-1], p])
            else:
                merged.append(p)
        self.parts = nn.ModuleList(merged)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = merged[0].num_cols
        self._calls = None  # per part, a function of x: built on first use, dropped when the module is moved
        self._norms = None  # greedy()'s bounds, made on first use

    def _apply(self, fn, recurse=True):
        self._calls = None
        return super()._apply(fn, recurse)

    def _prepare(self) -> list:
        self._calls = [p.matmul_fn() for p in self.parts]
        return self._calls

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's first index of its largest x @ W^T (x [R, K] fp32), the products in fp32, computed for a few
        candidates only (the kernels' greedy_pick, after products in the AMX tiles of the rows rounded to bf16, or
        of the rows rounded to 8 bits times Q8 codes, in the AMX-INT8 tiles up to 16 rows, or without AMX in
        AVX512-VNNI); None where that path does not apply (neither AMX nor VNNI with Q8 codes, fewer than
        GREEDY_MIN_ROWS rows, or GREEDY_INT8_MIN_ROWS for Q8 codes in the AMX-INT8 tiles, a weight not
        expands_alike, a bias, x not finite), and the caller computes the logits."""
        ops = kernels.load()
        if (ops is None or len(self.parts) != 1 or self.bias is not None or x.dim() != 2 or x.dtype != torch.float32
                or not x.is_cpu or len(x) < GREEDY_INT8_MIN_ROWS):
            return None
        part = self.parts[0]
        if part.int8_activations or not part.expands_alike:
            return None
        call = (self._calls or self._prepare())[0]
        tiles, int8 = ops.best_isa() == "amx", ops.greedy_int8(call)
        if not (tiles or int8) or len(x) < (GREEDY_INT8_MIN_ROWS if tiles and int8 else GREEDY_MIN_ROWS):
            return None
        if self._norms is None:
            self._norms = part.bf16_error_norms()
        ids = ops.greedy_pick(call, x.contiguous(), self._norms)
        return ids if bool((ids >= 0).all()) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self._calls or self._prepare()
        if len(calls) == 1 and self.bias is None and x.dim() == 2 and kernels_take(x.dtype):
            return calls[0](x)  # a stage's usual case, ~120 times a decode step
        x2 = x.reshape(-1, self.in_features)                                   # [T, K]
        if not kernels_take(x2.dtype):
            x2 = x2.float()
        y = calls[0](x2) if len(calls) == 1 else torch.cat([c(x2) for c in calls], dim=-1)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if y.dtype == x.dtype else y.to(x.dtype)


def kernels_take(dtype: torch.dtype) -> bool:
    """Whether rows of dtype go to the kernels as they are: fp32 always, bf16 where bf16_rows_to_kernels()."""
    return dtype == torch.float32 or dtype == torch.bfloat16 and bf16_rows_to_kernels()


@functools.cache
def bf16_rows_to_kernels() -> bool:
    """Whether bf16 rows go to the kernels as they are: many rows multiply bf16 weights (AMX tiles, or slices for
    torch's bf16 matmul), which is worth it only where the CPU has bf16 instructions (elsewhere it crawls)."""
    return kernels.has_bf16_matmul() and kernels.load() is not None


class CompactEmbedding(nn.Module):
    def __init__(self, weight: QuantWeight | None, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, -1)

    def dequantize(self) -> torch.Tensor:
        """The whole table, fp32 [N, K]."""
        return self.weight.dequantize()


class MappedEmbedding(CompactEmbedding):
    """An embedding table left in its checkpoint file: a lookup copies only its rows out of a memory map of the
    table's bytes and expands them (`expand`: rows of bytes [T, row_bytes] -> values [T, K]). A stage that only
    looks the table up (no tied LM head beside it) holds no copy; the rows it touches are file pages, which the OS
    shares between processes and can drop."""

    def __init__(self, path: str, offset: int, num_rows: int, row_bytes: int, expand, source: str,
                 dtype: torch.dtype):
        super().__init__(None, dtype)
        # a map of its own: one shared with the loader would keep every page the load read counted as resident
        self.table = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(num_rows * row_bytes,))
        self.table = self.table.reshape(num_rows, row_bytes)
        self.expand, self.source, self.num_rows, self.nbytes = expand, source, num_rows, num_rows * row_bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table[ids.reshape(-1).cpu().numpy()]                       # [T, row_bytes]: a copy
        return self.expand(rows).to(self.dtype).reshape(*ids.shape, -1)

    def dequantize(self) -> torch.Tensor:
        return self.expand(np.array(self.table)).float()


_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def set_int8_activations(model: nn.Module, on: bool) -> None:
    """EngineConfig.int8_activations for every compact weight below model."""
    for m in model.modules():
        if isinstance(m, QuantWeight):
            m.int8_acts = on
        elif isinstance(m, CompactLinear):
            m._calls = None
        elif getattr(m, "_fused", None) is not None:  # a stage's one-call decode layers hold the old setting
            m._fused = None


def densify(model: nn.Module, dtype: torch.dtype) -> None:
    """Compact weights below model expanded to dense ones in dtype, for a GPU stage (our compact kernels are CPU
    code): linears to nn.Linear, embeddings to nn.Embedding."""
    for name, child in model.named_children():
        if isinstance(child, CompactLinear):
            weight = torch.cat([p.dequantize() for p in child.parts]).to(dtype)                # [out, in]
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=child.bias is not None, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if child.bias is not None:
                linear.bias = nn.Parameter(child.bias.to(dtype), requires_grad=False)
            setattr(model, name, linear)
        elif isinstance(child, CompactEmbedding):
            setattr(model, name, nn.Embedding.from_pretrained(child.dequantize().to(dtype)))
        else:
            densify(child, dtype)


def weight_bytes(model: nn.Module) -> list[tuple[str, int]]:
    """(format, bytes) of the weights a model holds, largest first; a tensor shared by two modules (tied
    embeddings) counts once."""
    seen, totals = set(), {}

    def add(fmt: str, t: torch.Tensor | None) -> None:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            totals[fmt] = totals.get(fmt, 0) + t.nbytes

    for m in model.modules():
        if isinstance(m, QuantWeight):
            for t in m._tensors():
                add(m.source, t)
        elif isinstance(m, MappedEmbedding):
            totals[m.source + MAPPED] = totals.get(m.source + MAPPED, 0) + m.nbytes
    for p in model.parameters():
        add(_DTYPE_NAMES.get(p.dtype, str(p.dtype)), p)
    return sorted(totals.items(), key=lambda kv: -kv[1])
