"""GGUF checkpoints: a ``.gguf`` file (or the first of a ``-00001-of-0000N.gguf`` split set) read with
llama.cpp's own reader (the ``gguf`` package, memory-mapped), seen as the engine's checkpoint.

:func:`load_gguf` gives the normalised :class:`~engine.config.ModelConfig` (built from the GGUF metadata
through ``ModelConfig.from_hf``, so the same checks apply) and a :class:`~engine.checkpoint.Checkpoint`
whose keys are the Hugging Face names the family key map (``engine.families``) asks for; each value is a
zero-copy view of the file mapping in its stored type. Fused expert tensors (``ffn_*_exps`` [E, I, D])
appear as per-expert keys, each a contiguous slice.

Architectures: llama (mixtral when it has experts), qwen2, qwen3, qwen2moe, qwen3moe, olmoe, and glm4moe /
deepseek2 (``engine/gguf_deepseek.py``: their metadata, tensor names and MTP layers); anything else is
refused by name. New families register a translator in ``ARCHITECTURES``. llama GGUFs store the q/k rows
permuted for ggml's rotary layout (``convert_hf_to_gguf``); the engine undoes it on the outputs of the
projection (:class:`PermutedRows`), which moves values and changes no arithmetic.

Every problem raises :class:`~engine.checkpoint.CheckpointError` with one line naming the file and the
tensor or type.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_deepseek
from .checkpoint import Checkpoint, CheckpointError, TensorRef
from .config import ConfigError, ModelConfig
from .limits import GGUF_MAX_ARRAY_ITEMS, GGUF_MAX_SPLITS
from .quant import BLOCKS, SUPPORTED_TYPES

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" and not p.is_dir()


def split_files(path: Path) -> list[Path]:
    """The files of a GGUF: itself, or every file of its split set (``path`` must be the first)."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if no != 1:
        raise CheckpointError(f"{path}: is part {no} of a split GGUF; give the first file (-00001-of-{m['count']})")
    if not 1 <= count <= GGUF_MAX_SPLITS:
        raise CheckpointError(f"{path}: split count {count} is out of range (1-{GGUF_MAX_SPLITS})")
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: missing part of the split GGUF {path.name}")
    return files


def _reader(path: Path) -> Any:
    """``gguf.GGUFReader`` over ``path``; a bad file raises CheckpointError naming the tensor if it can."""
    import gguf

    class _Reader(gguf.GGUFReader):  # type: ignore[misc]
        _depth = 0  # nesting of _get_field_parts (0: a key/value's value)
        _last_str: Any = b""  # the string read last: a key/value's key, when its value is read

        def _get_str(self, offset: int) -> Any:
            got = super()._get_str(offset)
            self._last_str = got[1]
            return got

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            # gguf's reader walks an array item by item, and a read past the end of the file gives an empty
            # item without an error: a count of 2**60 loops for ever, nested arrays exhaust memory. So an
            # array's count is checked against what the rest of the file can hold before it is walked.
            key = bytes(self._last_str[:80]).decode("utf-8", "replace") if self._depth == 0 else "?"
            if raw_type == gguf.GGUFValueType.ARRAY:
                head = self.data[orig_offs : orig_offs + 12]
                if len(head) < 12:
                    raise CheckpointError(f"{path}: truncated: metadata {key!r} ends at the end of the file")
                item_type, count = struct.unpack("<IQ", bytes(head))
                if item_type == gguf.GGUFValueType.ARRAY:
                    raise CheckpointError(f"{path}: metadata {key!r} is a nested array (not supported)")
                scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type)) \
                    if item_type in gguf.GGUFValueType._value2member_map_ else None
                least = 8 if item_type == gguf.GGUFValueType.STRING else (
                    np.dtype(scalar).itemsize if scalar is not None else 1)
                left = len(self.data) - orig_offs - 12
                if count > GGUF_MAX_ARRAY_ITEMS:
                    raise CheckpointError(f"{path}: metadata {key!r} is an array of {count} items "
                                          f"(at most {GGUF_MAX_ARRAY_ITEMS})")
                if count * least > left:
                    raise CheckpointError(f"{path}: truncated: metadata {key!r} is an array of {count} items, "
                                          f"the {left} bytes left in the file hold fewer")
            self._depth += 1
            try:
                return super()._get_field_parts(orig_offs, raw_type)
            finally:
                self._depth -= 1

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise CheckpointError(f"{path}: tensor {name!r} has unknown type id {int(raw_dtype[0])}") from None
                bs, ts = gguf.GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims.astype(np.int64)))
                end = int(start_offs + int(offset[0]) + n // bs * ts)
                if end > size:
                    raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end}, file has {size}")
            super()._build_tensors(start_offs, fields)

    try:
        return _Reader(str(path), "r")
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path}: not a readable GGUF file ({first})") from None


def _short(value: object, chars: int = 80) -> str:
    """``repr(value)`` cut to ``chars`` (a hostile file's strings may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= chars else text[:chars] + f"... ({len(text)} chars)"


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value


def read_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _field_value(field)
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            out[key] = None
            out.setdefault("_bad_fields", []).append(f"{key} ({e})")
    return out


# --- architectures -----------------------------------------------------------------------------------

# GGUF architecture -> (Hugging Face model_type for a dense / an MoE file)
def _hf_type(arch: str, experts: int) -> str:
    return {
        "llama": "mixtral" if experts else "llama",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "qwen2moe": "qwen2_moe",
        "qwen3moe": "qwen3_moe",
        "olmoe": "olmoe",
    }[arch]


def _hf_config(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """GGUF metadata -> a Hugging Face style config dict for ``ModelConfig.from_hf``."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}")
        return default if v is None else v

    experts = int(get("expert_count", 0) or 0)
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    raw: dict[str, Any] = {
        "model_type": _hf_type(arch, experts),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"),
        "intermediate_size": get("feed_forward_length"),
        "tie_word_embeddings": False,  # decided from the tensors by load_gguf
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    key_len = get("attention.key_length")
    if key_len is not None:
        raw["head_dim"] = key_len
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear)")
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if experts:
        raw["num_experts"] = experts
        raw["num_local_experts"] = experts
        raw["num_experts_per_tok"] = get("expert_used_count")
        if arch in ("qwen2moe", "qwen3moe"):
            raw["moe_intermediate_size"] = get("expert_feed_forward_length")
        elif arch == "llama":
            raw["intermediate_size"] = get("expert_feed_forward_length") or get("feed_forward_length")
        if arch == "qwen2moe":
            raw["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length", 0)
        # llama.cpp renormalises the top-k weights of qwen3moe (and mixtral); not of qwen2moe/olmoe
        raw["norm_topk_prob"] = bool(get("expert_weights_norm", arch in ("qwen3moe", "llama")))
    if arch == "llama" and experts:
        window = get("attention.sliding_window")
        if window:
            raw["sliding_window"] = window
    if arch == "olmoe":
        clamp = get("attention.clamp_kqv")
        if clamp:
            raw["clip_qkv"] = clamp
    if arch == "qwen2":
        raw["qkv_bias"] = True
    return raw


# Translators: architecture -> GGUF metadata -> HF config dict (glm4moe/deepseek2: engine/gguf_deepseek.py,
# with their own tensor names).
ARCHITECTURES: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    a: _hf_config for a in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe")
}
ARCHITECTURES.update({a: gguf_deepseek.hf_config for a in gguf_deepseek.ARCHES})

# GGUF per-layer tensor name -> Hugging Face name after ``model.layers.{i}.`` ({moe} = mlp or
# block_sparse_moe). ``*_exps`` are expanded per expert in ``_expert_refs``.
TENSOR_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "{moe}.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_EXPS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """What :func:`load_gguf` read: config, checkpoint (HF keys), metadata, and the files."""

    config: ModelConfig
    checkpoint: Checkpoint
    metadata: dict[str, Any]
    files: list[Path]
    # q/k rows stored in ggml's rotary order (llama): HF key -> heads, to be undone on the outputs
    permuted: dict[str, int]
    # HF key -> (file, first byte, end byte) of its stored data (absolute offsets, for range mappings)
    offsets: dict[str, tuple[Path, int, int]]
    hf_config: dict[str, Any]


def _ref(path: Path, t: Any, key: str) -> TensorRef:
    import gguf

    qtype = gguf.GGMLQuantizationType(t.tensor_type).name
    shape = tuple(int(v) for v in reversed(t.shape.tolist()))
    if qtype not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has type {qtype}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})")
    bs, _ = BLOCKS[qtype]
    if shape[-1] % bs:
        raise CheckpointError(f"{path}: tensor {t.name!r} rows of {shape[-1]} are not whole {qtype} blocks")
    data = np.asarray(t.data)
    if qtype == "F32":
        data = data.view(np.float32).reshape(shape)
    elif qtype in ("F16", "BF16"):
        data = data.view(np.float16 if qtype == "F16" else np.uint16).reshape(shape)
    else:
        data = data.view(np.uint8).reshape(*shape[:-1], -1)
    return TensorRef(key=key, file=path, dtype=qtype, shape=shape, data=data)


def load_gguf(path: str | Path) -> GGUFSource:
    """Read a GGUF model (one file or a split set). Raises CheckpointError / ConfigError, one line each."""
    first = Path(path)
    if not first.is_file():
        raise CheckpointError(f"{first}: file not found")
    files = split_files(first)
    readers = [_reader(f) for f in files]
    meta = read_metadata(readers[0])
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{first}: GGUF architecture {_short(arch)} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    try:
        raw = ARCHITECTURES[arch](meta, arch)
        names = {t.name for r in readers for t in r.tensors}
        raw["tie_word_embeddings"] = "output.weight" not in names
        if arch in gguf_deepseek.ARCHES:  # attention options: from the tensors present
            raw["attention_bias"] = any(n.endswith((".attn_q.bias", ".attn_kv_a_mqa.bias")) for n in names)
            raw["use_qk_norm"] = any(n.endswith(".attn_q_norm.weight") for n in names)
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{first}: {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{first}: malformed {arch} metadata ({e})") from None
    moe = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    expert_names = (("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj"))
    tensors: dict[str, TensorRef] = {}
    offsets: dict[str, tuple[Path, int, int]] = {}
    for f, r in zip(files, readers):
        for t in r.tensors:
            name = t.name
            begin = int(t.data_offset)
            if name in GLOBAL_NAMES:
                tensors[GLOBAL_NAMES[name]] = _ref(f, t, GLOBAL_NAMES[name])
                offsets[GLOBAL_NAMES[name]] = (f, begin, begin + int(t.n_bytes))
                continue
            m = _BLK.match(name)
            if m is None:
                raise CheckpointError(f"{f}: tensor {name!r} is not used by the {arch} model")
            layer, rest = int(m[1]), m[2]
            prefix = f"model.layers.{layer}"
            if cfg.num_layers <= layer < cfg.num_layers + cfg.mtp_layers:
                continue  # multi-token-prediction layers (glm4moe's nextn) are not run
            if rest in _EXPS:
                ref = _ref(f, t, name)
                if len(ref.shape) != 3:
                    raise CheckpointError(f"{f}: tensor {name!r} has shape {list(ref.shape)}, expected 3-D")
                role = expert_names[_EXPS[rest]]
                per = int(t.n_bytes) // ref.shape[0]
                for e in range(ref.shape[0]):
                    key = f"{prefix}.{moe}.experts.{e}.{role}.weight"
                    tensors[key] = TensorRef(key=key, file=f, dtype=ref.dtype, shape=ref.shape[1:],
                                             data=ref.data[e])
                    offsets[key] = (f, begin + e * per, begin + (e + 1) * per)
                continue
            hf_name = TENSOR_NAMES.get(rest)
            if arch in gguf_deepseek.ARCHES:
                own = gguf_deepseek.tensor_name(arch, rest)  # None: a generic name; "": one it does not use
                hf_name = hf_name if own is None else own
            if not hf_name:
                raise CheckpointError(f"{f}: tensor {name!r} is not used by the {arch} model")
            key = f"{prefix}.{hf_name.format(moe=moe)}"
            ref = _ref(f, t, key)
            if rest == "ffn_gate_inp_shexp.weight" and len(ref.shape) == 1:
                ref = TensorRef(key=key, file=f, dtype=ref.dtype, shape=(1, ref.shape[0]),
                                data=ref.data.reshape(1, -1))
            tensors[key] = ref
            offsets[key] = (f, begin, begin + int(t.n_bytes))
    permuted: dict[str, int] = {}
    if arch == "llama":
        for i in range(cfg.num_layers):
            permuted[f"model.layers.{i}.self_attn.q_proj.weight"] = cfg.num_heads
            permuted[f"model.layers.{i}.self_attn.k_proj.weight"] = cfg.num_kv_heads
    ckpt = Checkpoint(first.parent, [], tensors)
    ckpt.files = files  # type: ignore[assignment]
    return GGUFSource(cfg, ckpt, meta, files, permuted, offsets, raw)


def unpermute_index(rows: int, heads: int) -> np.ndarray:
    """Index ``p`` with ``hf_out = gguf_out[..., p]`` for q/k rows permuted by ``convert_hf_to_gguf``
    (each head's rows ``[2, hd/2]`` stored as ``[hd/2, 2]``)."""
    hd = rows // heads
    idx = np.arange(rows).reshape(heads, hd // 2, 2)  # stored order
    return idx.transpose(0, 2, 1).reshape(rows)


@dataclass(frozen=True, slots=True)
class PermutedRows:
    """A weight whose output rows are stored permuted; ``x @ w.T`` returns them in Hugging Face order."""

    w: Any  # np.ndarray | Packed
    index: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes)

    @property
    def T(self) -> _PermT:  # noqa: N802
        return _PermT(self)


@dataclass(frozen=True, slots=True)
class _PermT:
    p: PermutedRows

    __array_ufunc__ = None

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((x @ self.p.w.T)[:, self.p.index])
