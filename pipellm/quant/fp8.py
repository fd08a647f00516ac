"""Block-scaled FP8, the form DeepSeek V3/R1's, Kimi K2's and Qwen3-FP8's checkpoints hold their linear layers in
(quant_method "fp8", HF's FineGrainedFP8): NAME [out, in] float8_e4m3fn, and NAME_scale_inv [ceil(out / bm),
ceil(in / bn)] fp32, each weight the FP8 value times the scale of its bm x bn block (weight_block_size; the last
blocks of a row or column may be short). Made dense at load, as our kernels multiply no FP8 (quantization="int8" or
"int4" compacts them again)."""
import torch

SCALES = "_scale_inv"


def scales_name(name: str, names) -> str | None:
    """The scales' name where name is an FP8 weight with its scales in names, else None."""
    return name + SCALES if name.endswith(".weight") and name + SCALES in names else None


def is_scales(name: str, names) -> bool:
    """Whether name is the scales of a weight in names (read with it)."""
    stem = name.removesuffix(SCALES)
    return stem != name and stem.endswith(".weight") and stem in names


def dequantize(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """weight [out, in] float8_e4m3fn and scales [ceil(out / bm), ceil(in / bn)] -> [out, in] in dtype, a row of
    blocks at a time (a whole tensor in fp32 would take 4x its bytes twice over)."""
    if len(block) != 2:
        raise ValueError("FP8 scales, but config.json's quantization_config gives no weight_block_size")
    (rows, cols), (bm, bn) = weight.shape, block
    grid = (-(-rows // bm), -(-cols // bn))
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or tuple(scales.shape) != grid:
        raise ValueError(f"FP8 weight {list(weight.shape)} {weight.dtype} with scales {list(scales.shape)}: expected "
                         f"float8_e4m3fn [out, in] with [{grid[0]}, {grid[1]}] scales for {bm} x {bn} blocks")
    out = torch.empty(rows, cols, dtype=dtype)
    for r in range(grid[0]):
        scale = scales[r].float().repeat_interleave(bn)[:cols]                          # [in]
        out[r * bm:(r + 1) * bm] = (weight[r * bm:(r + 1) * bm].float() * scale).to(dtype)
    return out
