"""FP8 block-scaled weights, as DeepSeek-V3 and the GLM FP8 checkpoints ship them.

A linear weight ``W`` [N, K] is stored as ``float8_e4m3fn`` bytes (safetensors dtype ``F8_E4M3``) next to
``{name}_scale_inv`` [ceil(N/bn), ceil(K/bk)] (fp32, or bf16), one scale per ``bn x bk`` block (128 x 128:
``quantization_config.weight_block_size``). The real weight is ``fp8_value * scale_inv`` of its block.

numpy has no fp8 dtype: :data:`E4M3_TO_F32` decodes the 256 bit patterns (1 sign bit, 4 exponent bits
with bias 7, 3 mantissa bits; exponent 0 is subnormal; ``S.1111.111`` is NaN; no infinities). Every fp8
value is exact in fp32, and ``value * scale`` is one fp32 rounding, as ``w.to(float32) * scale`` is in torch.

:class:`Fp8Tensor` keeps the bytes (a view of the file mapping) and dequantizes on demand, one row block
at a time, so a weight that is not widened at load never exists in fp32 outside the call that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32


def _e4m3_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = bits & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    out = (sign * mag).astype(F32)
    out[(exp == 0xF) & (man == 0x7)] = np.nan  # 0x7F and 0xFF
    return out


E4M3_TO_F32 = _e4m3_table()  # [256] fp32


def decode_e4m3(data: np.ndarray) -> np.ndarray:
    """uint8 bit patterns (any shape) -> their fp32 values."""
    return E4M3_TO_F32[data]


def dequantize(data: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """[N, K] uint8 fp8 with [ceil(N/bn), ceil(K/bk)] fp32 block scales -> [N, K] fp32."""
    n, k = data.shape
    bn, bk = block
    out = np.empty((n, k), dtype=F32)
    for r, a in enumerate(range(0, n, bn)):
        b = min(n, a + bn)
        s = np.repeat(scale_inv[r], bk)[:k]  # [K]: each column's block scale for this row block
        np.multiply(E4M3_TO_F32[data[a:b]], s, out=out[a:b])
    return out


@dataclass(frozen=True, slots=True)
class Fp8Tensor:
    """A block-scaled fp8 weight, kept as bytes. ``f32()`` dequantizes the whole matrix."""

    key: str
    data: np.ndarray  # [N, K] uint8 (read-only view of the mapping)
    scale_inv: np.ndarray  # [ceil(N/bn), ceil(K/bk)] fp32
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale_inv.nbytes)

    def f32(self) -> np.ndarray:
        return dequantize(self.data, self.scale_inv, self.block)


def scale_key(key: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    return key + "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"fp8 block scales need a 2-D weight, got shape {list(shape)}")
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
