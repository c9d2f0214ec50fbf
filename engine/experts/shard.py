"""Expert shards a worker holds: ``--experts PATH[@LAYERS/EXPERTS]`` parsing, validation and weights.

``LAYERS`` and ``EXPERTS`` are comma-separated inclusive ranges (``0-23``, ``5``, ``0-3,8-11``). Without a
suffix the shard is every routed expert of every sparse layer. :func:`load_shard` checks every held
tensor against the checkpoint's header (present, right shape, supported dtype) before anything is mapped,
refuses dense layers and out-of-range indices, and maps only the held tensors' bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.experts.layout import LayoutError, MoeLayout, layout_from_config, read_config
from engine.experts.rpc import ShardRange
from engine.experts.tensors import RangeMaps, TensorFileError, TensorInfo, as_f32, index_checkpoint
from engine.fp8 import dequantize, scale_shape
from engine.gguf_file import is_gguf
from engine import dense
from engine.quant import SUPPORTED_TYPES, QuantTypeError, packed, row_bytes, warm_kernels

_RANGES = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class ShardError(Exception):
    """An ``--experts`` spec or the checkpoint it names is unusable; the message says what and where."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    path: Path
    layers: tuple[tuple[int, int], ...] | None  # inclusive ranges; None = every sparse layer
    experts: tuple[tuple[int, int], ...] | None  # inclusive ranges; None = every expert


def _parse_ranges(text: str, what: str, spec: str) -> tuple[tuple[int, int], ...]:
    if not _RANGES.match(text):
        raise ShardError(f"--experts {spec}: {what} must look like 0-23 or 0-3,8-11, got {text!r}")
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a > b:
            raise ShardError(f"--experts {spec}: {what} range {part} is empty")
        out.append((a, b))
    return tuple(out)


def parse_spec(spec: str) -> ShardSpec:
    """Parse ``PATH[@LAYERS/EXPERTS]``; raises :class:`ShardError` with a one-line reason."""
    if not spec:
        raise ShardError("--experts needs a checkpoint path")
    path, at, suffix = spec.rpartition("@")
    if at and "/" in suffix and re.match(r"^[\d,\-]+/[\d,\-]+$", suffix):
        layers_text, _, experts_text = suffix.partition("/")
        return ShardSpec(Path(path), _parse_ranges(layers_text, "LAYERS", spec),
                         _parse_ranges(experts_text, "EXPERTS", spec))
    if at and re.match(r"^[\d,\-/]*$", suffix):
        raise ShardError(f"--experts {spec}: the suffix must be @LAYERS/EXPERTS, e.g. @0-23/0-63")
    return ShardSpec(Path(spec), None, None)


def _expand(ranges: tuple[tuple[int, int], ...]) -> list[int]:
    return sorted({i for a, b in ranges for i in range(a, b + 1)})


def _rectangles(layers: list[int], experts: list[int]) -> tuple[ShardRange, ...]:
    def runs(values: list[int]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for v in values:
            if out and v == out[-1][1] + 1:
                out[-1] = (out[-1][0], v)
            else:
                out.append((v, v))
        return out

    return tuple(ShardRange(la, lb, ea, eb) for la, lb in runs(layers) for ea, eb in runs(experts))


@dataclass(eq=False)
class ExpertShard:
    """Held routed experts of one checkpoint, memory-mapped. ``weights(layer, expert)`` -> the triple in its
    stored type (``engine.quant`` weights, as the local engine holds them)."""

    path: Path
    layout: MoeLayout
    layers: tuple[int, ...]
    experts: tuple[int, ...]
    tensors: dict[tuple[int, int], tuple[TensorInfo, TensorInfo, TensorInfo]]
    maps: RangeMaps
    _held: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    # FP8 experts: the weight_scale_inv of each of (gate, up, down), by (layer, expert)
    scales: dict[tuple[int, int], tuple[TensorInfo, TensorInfo, TensorInfo]] = field(default_factory=dict)

    _f32: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._held = frozenset(self.tensors)

    @property
    def ranges(self) -> tuple[ShardRange, ...]:
        return _rectangles(list(self.layers), list(self.experts))

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for triple in self.tensors.values() for t in triple)

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._held

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, D], up [I, D], down [D, I]) in the stored type, as ``Model.expert_weights`` gives them
        (so ``expert_ffn`` runs the same kernels here and locally); raises ``KeyError`` if not held."""
        views = self._f32.get((layer, expert))
        if views is not None:
            return views
        g, u, d = self.tensors[(layer, expert)]
        scales = self.scales.get((layer, expert))
        if scales is not None:  # FP8 with block scales: dequantized per use, as the local path does
            block = self.layout.config.fp8_block
            w = [dequantize(self.maps.array(t), as_f32(self.maps.array(s), s.dtype), block)
                 for t, s in zip((g, u, d), scales)]
            return w[0], w[1], w[2]
        triple = tuple(packed(self.maps.array(t), t.dtype, t.shape) for t in (g, u, d))
        self._f32[(layer, expert)] = triple  # type: ignore[assignment]  # views of the mapping: no memory
        return triple  # type: ignore[return-value]

    def warm(self) -> None:
        """Load the compiled kernels the held experts will use (numba's import and cache, or its compile where
        the cache is cold), as ``Model.load`` does for the local engine: the first request does not stall
        past a message timeout. Nothing without numba or for FP8 experts (dequantized per use)."""
        for key in self.tensors:
            if key in self.scales:
                continue
            triple = list(self.weights(*key))
            warm_kernels(triple)
            dense.warm(triple)
            if dense.swiglu_compiled(np.zeros((1, triple[0].shape[1]), dtype=np.float32), triple[0]):
                dense.warm_step()
            return

    def close(self) -> None:
        self._f32.clear()
        self.maps.close()


def _check(path: Path, t: TensorInfo | None, name: str, shape: tuple[int, ...]) -> TensorInfo:
    if t is None:
        raise ShardError(f"--experts {path}: missing expert tensor {name}")
    if t.shape != shape:
        raise ShardError(f"--experts {path}: expert tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
    if t.dtype not in SUPPORTED_TYPES and t.dtype != "F8_E4M3":
        raise ShardError(f"--experts {path}: expert tensor {name} has unsupported dtype {t.dtype}")
    if t.dtype == "F8_E4M3":
        need = int(np.prod(shape))  # one byte per weight; its block scales are checked with the layout
    else:
        try:
            need = row_bytes(t.dtype, shape[-1]) * int(np.prod(shape[:-1]))
        except QuantTypeError as e:
            raise ShardError(f"--experts {path}: expert tensor {name}: {e}") from None
    if t.nbytes != need:
        raise ShardError(f"--experts {path}: expert tensor {name} has {t.nbytes} bytes for shape {list(shape)}")
    return t


def _per_expert(path: Path, layout: MoeLayout, index: dict[str, TensorInfo], layer: int,
                expert: int) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
    names = layout.expert_names(layer, expert)
    g, u, d = (_check(path, index.get(n), n, shape) for n, shape in zip(names, layout.expert_shapes()))
    return g, u, d


def _fp8_scales(path: Path, layout: MoeLayout, index: dict[str, TensorInfo],
                triple: tuple[TensorInfo, TensorInfo, TensorInfo]) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
    """The block scales of an FP8 expert's three weights (all three must be FP8)."""
    if {t.dtype for t in triple} != {"F8_E4M3"}:
        raise ShardError(f"--experts {path}: expert tensors {triple[0].name} and its siblings mix F8_E4M3 "
                         f"with other dtypes")
    out = []
    for t in triple:
        name = t.name + "_scale_inv"
        info = index.get(name)
        shape = scale_shape(t.shape, layout.config.fp8_block)
        if info is None or info.shape != shape or info.dtype not in ("F32", "BF16"):
            got = "missing" if info is None else f"{info.dtype}{list(info.shape)}"
            raise ShardError(f"--experts {path}: FP8 block scales {name} are {got}, expected F32{list(shape)}")
        out.append(info)
    return out[0], out[1], out[2]


def _fused_layer(path: Path, layout: MoeLayout, index: dict[str, TensorInfo], layer: int,
                 experts: list[int]) -> dict[tuple[int, int], tuple[TensorInfo, TensorInfo, TensorInfo]]:
    """Per-expert byte ranges inside the fused [E, 2I, D] / [E, D, I] tensors (each one contiguous)."""
    e, i, d = layout.num_experts, layout.intermediate_size, layout.hidden_size
    gu_name, dn_name = layout.fused_names(layer)
    gu = _check(path, index.get(gu_name), gu_name, (e, 2 * i, d))
    dn = _check(path, index.get(dn_name), dn_name, (e, d, i))
    if "F8_E4M3" in (gu.dtype, dn.dtype):
        raise ShardError(f"--experts {path}: fused FP8 expert tensors ({gu_name}) are not supported")
    isz = 4 if gu.dtype == "F32" else 2  # fused layouts are safetensors: F32, BF16 or F16
    dsz = 4 if dn.dtype == "F32" else 2
    out = {}
    for x in experts:
        g0 = gu.begin + x * 2 * i * d * isz
        u0 = g0 + i * d * isz
        d0 = dn.begin + x * d * i * dsz
        out[(layer, x)] = (TensorInfo(f"{gu_name}[{x}].gate", gu.file, gu.dtype, (i, d), g0, u0),
                           TensorInfo(f"{gu_name}[{x}].up", gu.file, gu.dtype, (i, d), u0, u0 + i * d * isz),
                           TensorInfo(f"{dn_name}[{x}]", dn.file, dn.dtype, (d, i), d0, d0 + d * i * dsz))
    return out


def check_ranges(spec: ShardSpec) -> tuple[MoeLayout, list[int], list[int]]:
    """The checkpoint's MoE layout (from its config or GGUF metadata only: no tensor is read) and the
    spec's layers and experts, checked against it. -> (layout, layers, experts); raises
    :class:`ShardError` naming the first problem (a dense model, a layer or expert that does not exist)."""
    path = spec.path.expanduser()
    try:
        layout = layout_from_config(read_config(path))
    except LayoutError as e:
        raise ShardError(f"--experts {path}: {e}") from None
    if spec.layers is None:
        layers = list(layout.sparse_layers)
    else:
        layers = _expand(spec.layers)
        for layer in layers:
            if layer >= layout.num_layers:
                raise ShardError(f"--experts {path}: layer {layer} does not exist (the model has "
                                 f"{layout.num_layers} layers)")
            if not layout.is_sparse(layer):
                raise ShardError(f"--experts {path}: layer {layer} is dense (it has no routed experts)")
    experts = list(range(layout.num_experts)) if spec.experts is None else _expand(spec.experts)
    if experts and experts[-1] >= layout.num_experts:
        raise ShardError(f"--experts {path}: expert {experts[-1]} does not exist (the model has "
                         f"{layout.num_experts} experts per layer)")
    return layout, layers, experts


def load_shard(spec: ShardSpec | str) -> ExpertShard:
    """Validate and map a shard; raises :class:`ShardError` naming the first problem found."""
    if isinstance(spec, str):
        spec = parse_spec(spec)
    path = spec.path.expanduser()
    if not path.is_dir() and not is_gguf(path):
        raise ShardError(f"--experts: {path} is not a checkpoint directory or a .gguf file")
    layout, layers, experts = check_ranges(spec)
    try:
        index = index_checkpoint(path)
    except TensorFileError as e:
        raise ShardError(f"--experts {path}: {e}") from None
    tensors: dict[tuple[int, int], tuple[TensorInfo, TensorInfo, TensorInfo]] = {}
    scales: dict[tuple[int, int], tuple[TensorInfo, TensorInfo, TensorInfo]] = {}
    for layer in layers:
        if layout.fused_names(layer)[0] in index:
            tensors.update(_fused_layer(path, layout, index, layer, experts))
            continue
        for expert in experts:
            triple = tensors[(layer, expert)] = _per_expert(path, layout, index, layer, expert)
            if any(t.dtype == "F8_E4M3" for t in triple):
                scales[(layer, expert)] = _fp8_scales(path, layout, index, triple)
    try:
        maps = RangeMaps(t for group in (tensors, scales) for triple in group.values() for t in triple)
    except TensorFileError as e:
        raise ShardError(f"--experts {path}: {e}") from None
    return ExpertShard(path=path, layout=layout, layers=tuple(layers), experts=tuple(experts),
                       tensors=tensors, maps=maps, scales=scales)
