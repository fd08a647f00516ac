"""GGUF's block formats repacked, without loss, into the layouts of quant/linear.py.

Each GGUF row of K weights is a run of blocks (32 weights, or 256 in the K-quants). Codes keep their bits: 4-bit
codes as nibbles, 5- and 6-bit codes as nibbles plus one or two bit planes. Scales that the file keeps as fp16 stay
fp16; the K-quants' two-level scales (an fp16 per 256 times a 6-bit integer per 32, or Q6_K's int8 per 16) stay
two-level. The kernels multiply the two levels in fp32, which is exact, so every weight expands to the same float as
in the `gguf` package's dequantize.
"""
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from pipellm.quant.linear import BF16, F16, F32, Q4, Q8, MappedEmbedding, QuantWeight

SUPPORTED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)
_BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210,
                T.MXFP4: 17}


def check_supported(qtype: T, name: str) -> None:
    if qtype not in SUPPORTED:
        raise ValueError(f"tensor {name} has GGUF type {qtype.name}, which pipellm cannot run; supported: "
                         f"{', '.join(t.name for t in SUPPORTED)}")


def mapped_embedding(path: str, offset: int, nbytes: int, qtype: T, num_rows: int, num_cols: int,
                     dtype: torch.dtype, name: str = "") -> MappedEmbedding:
    """A GGUF embedding table left in its file; its rows expand through the `gguf` package's dequantize (the same
    floats as repack's kernels give)."""
    check_supported(qtype, name)
    block, size = GGML_QUANT_SIZES[qtype]  # weights a block, bytes a block
    if num_cols % block or nbytes != num_rows * num_cols // block * size:
        raise ValueError(f"tensor {name}: {nbytes} bytes do not hold {num_rows} rows of {num_cols} "
                         f"{qtype.name} weights")

    def expand(rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(len(rows), num_cols))

    return MappedEmbedding(path, offset, num_rows, nbytes // num_rows, expand, qtype.name, dtype)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True, order="C"))  # owned memory: not a view of the file's map


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & np.uint8(15), b >> np.uint8(4)


def _pack_q4(q: np.ndarray) -> np.ndarray:
    """codes 0..15 [N, G, 32] -> our Q4 bytes [N, G * 16]: weight j in the low nibble, j + 16 in the high."""
    return (q[..., :16] | (q[..., 16:] << np.uint8(4))).reshape(q.shape[0], -1)


def _planes(bits: np.ndarray) -> np.ndarray:
    """0/1 bits [N, G, planes, 32] -> our bit planes [N, G * planes * 4]: per 32 weights a 4-byte run a plane."""
    return np.packbits(bits, axis=-1, bitorder="little").reshape(bits.shape[0], -1)


E2M1_TWICE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # 2 x E2M1 values


def e2m1_weight(codes: np.ndarray, scales: np.ndarray) -> QuantWeight | None:
    """MXFP4's blocks (GGUF's, and HF checkpoints' with quant/mxfp4.py) as the same matrix, exactly, in Q5_0's layout:
    E2M1 codes [N, G, 32] (each block's weights in order) and E8M0 scale bytes [N, G], a weight 2 * E2M1 (an integer
    in [-12, 12]: q - 16 of a 5-bit code) times d = 2 ** (scale - 128) (an fp16). 5.5 bits a weight where MXFP4 has
    4.25; None where a d is no fp16 (a scale byte outside [104, 143])."""
    if scales.size and (int(scales.min()) < 104 or int(scales.max()) > 143):
        return None
    q = (E2M1_TWICE[codes] + 16).astype(np.uint8)                                         # [N, G, 32] in 4..28
    d = np.ldexp(np.float32(1), scales.astype(np.int32) - 128).astype(np.float16)         # [N, G], exact
    return QuantWeight(Q4, _t(_pack_q4(q & np.uint8(15))), _t(d), source="MXFP4",
                       high=_t(_planes((q >> np.uint8(4))[:, :, None, :])), offset=16)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [N, S, 12] -> ([N, S, 8], [N, S, 8])."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate((d & 63, (md & 15) | ((d >> 2) & 48)), axis=-1)
    mn = np.concatenate((m & 63, (md >> 4) | ((m >> 2) & 48)), axis=-1)
    return sc, mn


def repack(raw: np.ndarray, qtype: T, num_rows: int, num_cols: int, name: str = "") -> QuantWeight:
    """raw: the tensor's bytes as GGUF stores them; returns the [num_rows, num_cols] weight in our layout."""
    check_supported(qtype, name)
    raw = np.asarray(raw).reshape(num_rows, -1)
    if qtype == T.F32:
        return QuantWeight(F32, _t(raw.view(np.float32)), source="F32")
    if qtype in (T.F16, T.BF16):
        codes = _t(raw.view(np.int16)).view(torch.float16 if qtype == T.F16 else torch.bfloat16)
        return QuantWeight(F16 if qtype == T.F16 else BF16, codes, source=qtype.name)
    if num_cols % 32:
        raise ValueError(f"tensor {name}: {num_cols} columns is not a multiple of 32")
    blocks = raw.view(np.uint8).reshape(num_rows, -1, _BLOCK_BYTES[qtype])    # [N, B, block bytes]
    n, src = num_rows, qtype.name
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(blocks[..., 0:2])
        m = _f16(blocks[..., 2:4]) if qtype == T.Q4_1 else (d * np.float16(-8)).astype(np.float16)  # w = d(q - 8)
        qs = blocks[..., 4:] if qtype == T.Q4_1 else blocks[..., 2:]
        return QuantWeight(Q4, _t(qs.reshape(n, -1)), _t(d), _t(m), source=src)  # already our nibble order
    if qtype == T.MXFP4:  # the scale byte, then weights 0-15 in the low nibbles, 16-31 in the high ones
        weight = e2m1_weight(np.concatenate(_nibbles(blocks[..., 1:]), axis=-1), blocks[..., 0])
        return weight or QuantWeight(F32, _t(np.asarray(dequantize(raw.reshape(-1), qtype), dtype=np.float32)
                                             .reshape(n, num_cols)), source="F32")
    if qtype == T.Q8_0:
        return QuantWeight(Q8, _t(blocks[..., 2:].reshape(n, -1).view(np.int8)), _t(_f16(blocks[..., 0:2])),
                           source=src)
    if qtype in (T.Q5_0, T.Q5_1):  # the file's nibble order is ours, and its qh (bit j: weight j) our plane
        d = _f16(blocks[..., 0:2])
        off = 4 if qtype == T.Q5_1 else 2
        qs, qh = _t(blocks[..., off + 4:].reshape(n, -1)), _t(blocks[..., off:off + 4].reshape(n, -1))
        if qtype == T.Q5_0:  # w = d (q - 16)
            return QuantWeight(Q4, qs, _t(d), source=src, high=qh, offset=16)
        return QuantWeight(Q4, qs, _t(d), _t(_f16(blocks[..., 2:4])), source=src, high=qh)
    if qtype in (T.Q4_K, T.Q5_K):
        # two-level scales kept as the file has them: fp16 d and dmin per 256, 6-bit multiples per 32
        d, dmin = _t(_f16(blocks[..., 0:2])), _t(_f16(blocks[..., 2:4]))       # [N, K/256]
        sc, mn = (_t(a.reshape(n, -1)) for a in _k_scales(blocks[..., 4:16]))  # [N, K/32] uint8
        qs = blocks[..., -128:].reshape(n, -1, 4, 32)                         # four 32-byte runs per 256
        lo, hi = _nibbles(qs)                                                 # sub-blocks 2i and 2i + 1
        q = np.stack((lo, hi), axis=3).reshape(n, -1, 32)                     # [N, K/32, 32]
        if qtype == T.Q4_K:
            return QuantWeight(Q4, _t(_pack_q4(q)), sc, mn, source=src, super_scale=d, super_min=dmin)
        qh = blocks[..., 16:48][:, :, None, :]                                # [N, B, 1, 32]: bit i for sub-block i
        bits = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)    # [N, B, 8, 32]
        return QuantWeight(Q4, _t(_pack_q4(q)), sc, mn, source=src, super_scale=d, super_min=dmin,
                           high=_t(_planes(bits.reshape(n, -1, 1, 32))))
    # Q6_K: ql [128], qh [64], 16 int8 scales, fp16 d; groups of 16
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    scales, d = blocks[..., 192:208].view(np.int8), _f16(blocks[..., 208:210])
    lo, hi = _nibbles(ql.reshape(n, -1, 2, 1, 64))                            # per 128 weights: 64 bytes
    low = np.concatenate((lo, hi), axis=3).reshape(n, -1, 8, 32)              # [N, B, 8, 32]
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & np.uint8(3)
    high = high.reshape(n, -1, 32)                                            # [N, K/32, 32]: bits 4-5 of each code
    bits = np.stack((high & np.uint8(1), high >> np.uint8(1)), axis=2)        # [N, K/32, 2, 32]
    return QuantWeight(Q4, _t(_pack_q4(low.reshape(n, -1, 32))), _t(scales.reshape(n, -1)), group=16, source=src,
                       super_scale=_t(d), high=_t(_planes(bits)), offset=32)  # w = d * scale * (q - 32)
