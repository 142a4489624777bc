"""MXFP4 (OCP microscaling FP4), the format of the expert weights in the Hub's gpt-oss folders, decoded to a float
dtype on conversion (`lit_gpt.convert`): the model runs bf16 experts, as transformers gives them with
`Mxfp4Config(dequantize=True)`. transformers is not needed at run time: the decoder is the few lines below.

A Hub folder stores each expert projection as two tensors:
  `<name>_blocks` uint8 (..., G, 16): 32 FP4 (E2M1) values per group, two per byte, the low nibble first;
  `<name>_scales` uint8 (..., G): one E8M0 scale per group, 2**(s - 127).
For gpt-oss the leading dims are (n_expert, out_features) and the G groups of 32 span in_features, so that the
decoded tensor is (n_expert, out, in): gate_up_proj (E, 2I, H) with gate/up rows interleaved, down_proj (E, H, I).
transformers' `integrations.mxfp4.convert_moe_packed_tensors` decodes the same bytes and then transposes the last
two dims into its in-memory (E, in, out) layout; tests/test_moe_parity.py holds the two to bit equality.
"""

from typing import Tuple

import torch

# the 16 E2M1 codes: sign bit 3, then exponent (2 bits) and mantissa (1 bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantized_shape(blocks_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return (*blocks_shape[:-2], blocks_shape[-2] * blocks_shape[-1] * 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(..., G, B) packed bytes and (..., G) exponents -> (..., G * 2B) values in `dtype`, decoded one slice of
    the first dim (one expert) at a time, so that the float32 intermediates stay one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 scales of shape {tuple(scales.shape)} do not match blocks of shape {tuple(blocks.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(dequantized_shape(tuple(blocks.shape)), dtype=dtype)
    group_bytes = blocks.shape[-1]
    rows_b = blocks.reshape(-1, *blocks.shape[-2:]) if blocks.dim() > 2 else blocks.unsqueeze(0)
    rows_s = scales.reshape(-1, scales.shape[-1]) if blocks.dim() > 2 else scales.unsqueeze(0)
    n_slices = blocks.shape[0] if blocks.dim() > 2 else 1
    per_slice = rows_b.shape[0] // n_slices
    out_rows = out.view(rows_b.shape[0], rows_b.shape[1], 2 * group_bytes)
    for j in range(n_slices):
        sl = slice(j * per_slice, (j + 1) * per_slice)
        packed = rows_b[sl].to(torch.int64)
        values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1)  # low nibble first
        exponent = rows_s[sl].to(torch.int32).sub(127).unsqueeze(-1)
        out_rows[sl] = torch.ldexp(values.flatten(-2), exponent).to(dtype)
    return out
