"""MXFP4 (OCP microscaling), the format GPT-OSS's checkpoints hold their experts in: NAME_blocks [..., out, G, 16]
uint8, 32 values a block, each a 4-bit E2M1 float, two to a byte (the low nibble first), and NAME_scales
[..., out, G] uint8, one E8M0 scale a block (2 ** (byte - 127)). Kept compact at load, exactly, in a layout our
kernels multiply (quant_weight); else dequantized, exactly too."""
import torch

from pipellm.quant.gguf_blocks import E2M1_TWICE, e2m1_weight
from pipellm.quant.linear import QuantWeight

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
    lut = torch.from_numpy(E2M1_TWICE).float()                                                # 2 x E2M1
    rows, exps = blocks.reshape(-1, 16), scales.reshape(-1, 1).int() - 128                    # [R, 16], [R, 1]
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
    """blocks [N, G, 16] and scales [N, G] as the same [N, G * 32] matrix, exactly, in Q5_0's layout that our kernels
    multiply (gguf_blocks.e2m1_weight); None where a scale has no fp16 form."""
    _check(blocks, scales)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(blocks.shape[0], -1, 32)  # [N, G, 32] in order
    return e2m1_weight(codes.numpy(), scales.numpy())
