"""Where a checkpoint keeps its routed experts: families, sparse layers and tensor names (pure).

Supported families (Hugging Face per-expert layout, which transformers 4 and 5 both write):

- ``qwen3_moe`` / ``qwen2_moe``: ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight``; a layer
  is sparse unless listed in ``mlp_only_layers`` and ``(L + 1) % decoder_sparse_step == 0``.
- ``mixtral``: ``model.layers.{L}.block_sparse_moe.experts.{E}.{w1,w3,w2}.weight`` (gate, up, down); every
  layer is sparse.

Shapes: gate and up are [I, D], down is [D, I] (I = ``moe_intermediate_size`` or ``intermediate_size``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class LayoutError(Exception):
    """The checkpoint is not an MoE model we can hold experts for; the message says why."""


@dataclass(frozen=True, slots=True)
class MoeLayout:
    family: str
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) tensor names of one routed expert."""
        if self.family == "mixtral":
            p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            return p + "w1.weight", p + "w3.weight", p + "w2.weight"
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        i, d = self.intermediate_size, self.hidden_size
        return (i, d), (i, d), (d, i)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def _int(cfg: dict[str, Any], *keys: str) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    raise LayoutError(f"config.json has no positive integer {' or '.join(keys)}")


def layout_from_config(cfg: dict[str, Any]) -> MoeLayout:
    """The MoE layout described by a Hugging Face ``config.json`` dict; raises :class:`LayoutError`."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    family = cfg.get("model_type")
    if family not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        raise LayoutError(f"model_type {family!r} has no routed experts meshd can delegate "
                          "(supported: qwen3_moe, qwen2_moe, mixtral)")
    layers = _int(cfg, "num_hidden_layers")
    experts = _int(cfg, "num_experts", "num_local_experts")
    hidden = _int(cfg, "hidden_size")
    top_k = _int(cfg, "num_experts_per_tok")
    if family == "mixtral":
        inter = _int(cfg, "intermediate_size")
        sparse = tuple(range(layers))
        norm = True
    else:
        inter = _int(cfg, "moe_intermediate_size")
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise LayoutError("config.json decoder_sparse_step must be a positive integer")
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(v, int) for v in dense):
            raise LayoutError("config.json mlp_only_layers must be a list of integers")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        norm = bool(cfg.get("norm_topk_prob", False))
    return MoeLayout(family=str(family), num_layers=layers, num_experts=experts, hidden_size=hidden,
                     intermediate_size=inter, top_k=top_k, norm_topk_prob=norm, sparse_layers=sparse)


def read_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict; raises :class:`LayoutError` with a readable reason."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{path} has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"{path}/config.json is unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"{path}/config.json is not a JSON object")
    return cfg
