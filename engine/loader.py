"""Taking a checkpoint's tensors as the engine's weights (``engine.model.Model.load``): by explicit key,
shape-checked, in their stored type (``engine.quant.packed``), FP8 with its block scales."""

from __future__ import annotations

import numpy as np

from . import families
from .checkpoint import Checkpoint, CheckpointError, ProgressFn, TensorRef, to_f32
from .config import ModelConfig
from .fp8 import Fp8Tensor, scale_key, scale_shape
from .gguf_file import PermutedRows, unpermute_index
from .quant import Packed, packed

_PAGE = 4096


def _widened(w: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(a.widen() if isinstance(a, Packed) else a.f32() if isinstance(a, Fp8Tensor) else a
                 for a in w)  # type: ignore[return-value]


class _Loader:
    """Takes tensors out of a checkpoint by explicit key, checking shape, and tracks what was used."""

    def __init__(self, ckpt: Checkpoint, progress: ProgressFn | None, prefetch: bool,
                 permuted: dict[str, int] | None = None, block: tuple[int, int] = (128, 128)) -> None:
        self.ckpt = ckpt
        self.permuted = permuted or {}
        self.block = block  # FP8 block-scale tile (weight_scale_inv)
        self.used: set[str] = set()
        self.progress = progress
        self.prefetch = prefetch
        self.total = ckpt.nbytes
        self.done = 0

    def ref(self, spec: families.Spec) -> TensorRef:
        key, shape = spec
        if key not in self.ckpt:
            raise CheckpointError(
                f"{self.ckpt.directory}: missing tensor {key!r} (expected shape {list(shape)})"
            )
        t = self.ckpt[key]
        if t.shape != shape:
            raise CheckpointError(
                f"{t.file}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        self.used.add(key)
        if self.prefetch and t.data.size:
            # Fault the tensor's pages in now (one byte per page) rather than during the first forward.
            t.data.reshape(-1).view(np.uint8)[::_PAGE].sum()
        self.done += t.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)
        return t

    def _fp8(self, t: TensorRef) -> Fp8Tensor:
        """F8_E4M3 bytes with their block scales (``weight_scale_inv``, taken here too)."""
        try:
            sshape = scale_shape(t.shape, self.block)
        except ValueError as exc:
            raise CheckpointError(f"{t.file}: tensor {t.key!r}: {exc}") from None
        s = self.ref((scale_key(t.key), sshape))
        return Fp8Tensor(t.key, t.data, to_f32(s.data, s.dtype), self.block)

    def _stored(self, t: TensorRef) -> np.ndarray | Packed | PermutedRows:
        heads = self.permuted.get(t.key.replace(".bias", ".weight"))
        if len(t.shape) != 2:
            v = to_f32(t.data, t.dtype)
            return v if heads is None else v[unpermute_index(v.shape[0], heads)]
        w = packed(t.data, t.dtype, t.shape)
        return w if heads is None else PermutedRows(w, unpermute_index(t.shape[0], heads))

    def weight(self, spec: families.Spec) -> np.ndarray | Packed | PermutedRows:
        """A matrix in its stored type (``engine.quant.packed``), a vector widened to fp32; FP8 with block
        scales widened to fp32 here (routed experts keep FP8: :meth:`expert`). The one place a tensor
        becomes a weight, for every family and file format."""
        t = self.ref(spec)
        return self._fp8(t).f32() if t.dtype == "F8_E4M3" else self._stored(t)

    def expert(self, spec: families.Spec) -> np.ndarray | Packed | PermutedRows | Fp8Tensor:
        """A routed expert's matrix as stored: like :meth:`weight`, but FP8 stays FP8 (dequantized per use
        by ``Model.expert_weights``: a DeepSeek-V3 widened to fp32 would need 4x its memory)."""
        t = self.ref(spec)
        return self._fp8(t) if t.dtype == "F8_E4M3" else self._stored(t)

    def f32(self, spec: families.Spec) -> np.ndarray:
        t = self.ref(spec)
        return self._fp8(t).f32() if t.dtype == "F8_E4M3" else to_f32(t.data, t.dtype)

    def group(self, specs: dict[str, families.Spec]) -> dict[str, np.ndarray]:
        return {role: self.weight(spec) for role, spec in specs.items()}  # type: ignore[misc]

    def check_unexpected(self, cfg: ModelConfig) -> None:
        tied = cfg.tie_word_embeddings
        for key in self.ckpt:
            if key in self.used or families.is_ignorable(cfg, key):
                continue
            if tied and key == "lm_head.weight":
                continue  # some exporters keep the tied head; the embedding is used, as the reference does
            raise CheckpointError(
                f"{self.ckpt.describe(key)} is not used by the {self.ckpt.directory.name!r} model"
            )


def widen(w: TensorRef | Fp8Tensor) -> np.ndarray:
    """A stored tensor in fp32 (fp32 storage: the view itself)."""
    if isinstance(w, Fp8Tensor):
        return w.f32()
    return to_f32(w.data, w.dtype)
