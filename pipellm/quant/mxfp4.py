"""MXFP4 (OCP microscaling), the format GPT-OSS's checkpoints hold their experts in: NAME_blocks [..., out, G, 16]
uint8, 32 values a block, each a 4-bit E2M1 float, two to a byte (the low nibble first), and NAME_scales
[..., out, G] uint8, one E8M0 scale a block (2 ** (byte - 127)). Kept compact at load, exactly, in a layout our
kernels multiply (quant_weight); else dequantized, exactly too."""
import numpy as np
import torch

from pipellm.quant.linear import Q4, QuantWeight

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
TWICE_E2M1 = torch.tensor([int(2 * v) for v in E2M1], dtype=torch.int32)  # integers in [-12, 12]
BLOCKS, SCALES = "_blocks", "_scales"


def packed_name(name: str, names) -> str | None:
    """The dense tensor's name where name is the blocks of an MXFP4 pair in names, else None."""
    stem = name.removesuffix(BLOCKS)
    return stem if stem != name and stem + SCALES in names else None


def is_scales(name: str, names) -> bool:
    """Whether name is the scales of an MXFP4 pair in names (read with its blocks)."""
    stem = name.removesuffix(SCALES)
    return stem != name and stem + BLOCKS in names


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 20) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in dtype, chunk blocks at a time (the
    lookup's indices and fp32 values of a whole layer's experts would take ~12x its packed bytes)."""
    _check(blocks, scales)
    lut = torch.tensor(E2M1)
    rows, exps = blocks.reshape(-1, 16), scales.reshape(-1, 1).int() - 127                    # [R, 16], [R, 1]
    out = torch.empty(len(rows), 32, dtype=dtype)                                             # [R, 32]
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        pair = torch.stack([lut[(part & 15).int()], lut[(part >> 4).int()]], dim=-1)          # [r, 16, 2]
        out[start:start + chunk] = torch.ldexp(pair.reshape(-1, 32), exps[start:start + chunk])
    return out.reshape(*blocks.shape[:-2], -1)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                         f"{scales.dtype}: expected uint8 [..., G, 16] and uint8 [..., G]")


def quant_weight(blocks: torch.Tensor, scales: torch.Tensor) -> QuantWeight | None:
    """blocks [N, G, 16] and scales [N, G] as the same [N, G * 32] matrix, exactly, in GGUF Q5_0's layout that our
    kernels multiply (Q4 codes with one bit plane, w = d (q - 16)): each value is 2 * E2M1 (an integer in [-12, 12])
    times d = 2 ** (scale - 128), an fp16. 5.5 bits a weight where MXFP4 has 4.25; None where a d is not an fp16
    (a scale byte outside [104, 143])."""
    _check(blocks, scales)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(blocks.shape[0], -1, 32)  # [N, G, 32] in order
    return _q5(codes, scales)


def quant_weight_of_gguf(blocks: torch.Tensor) -> QuantWeight | None:
    """GGUF's MXFP4 blocks [N, G, 17] (llama.cpp: the scale byte, then 16 bytes whose low nibbles are weights 0-15
    and high nibbles 16-31, each weight 2 * E2M1 * 2 ** (scale - 128)) as quant_weight's; None as there."""
    qs = blocks[..., 1:]
    return _q5(torch.cat([qs & 15, qs >> 4], dim=-1), blocks[..., 0])


def _q5(codes: torch.Tensor, scales: torch.Tensor) -> QuantWeight | None:
    """codes [N, G, 32] E2M1 codes of each block's weights in order, scales [N, G] their E8M0 bytes."""
    exps = scales.int() - 128
    if exps.numel() and (int(exps.min()) < -24 or int(exps.max()) > 15):
        return None
    n = codes.shape[0]
    q = (TWICE_E2M1[codes.int()] + 16).to(torch.uint8)                                    # [N, G, 32] in 4..28
    low = q & 15
    nibbles = low[..., :16] | (low[..., 16:] << 4)           # byte i: weights i and 16 + i, as Q5_0's
    planes = np.packbits(((q >> 4) & 1).numpy(), axis=-1, bitorder="little")              # [N, G, 4]: bit j, weight j
    d = torch.ldexp(torch.ones(exps.shape), exps).half()                                  # [N, G], exact
    return QuantWeight(Q4, nibbles.reshape(n, -1), d, source="MXFP4", high=torch.from_numpy(planes).reshape(n, -1),
                       offset=16)
