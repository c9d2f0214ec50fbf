"""Where a checkpoint keeps its routed experts: sparse layers and tensor names (pure).

Derived from the engine's own config normalisation (``engine.config.ModelConfig``) and key maps
(``engine.families``), so the worker and the local engine read exactly the same tensors. Every MoE family
the engine supports works (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE); shared experts stay on the coordinator.
Both per-expert and fused 3-D expert layouts are understood (see ``engine.families``).

Shapes: gate and up are [I, D], down is [D, I] (I = the routed expert width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import families
from engine.config import ConfigError, ModelConfig


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
    config: ModelConfig

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) tensor names of one routed expert in the per-expert layout."""
        sp = families.expert_tensors(self.config, layer, expert)
        return sp["gate"][0], sp["up"][0], sp["down"][0]

    def fused_names(self, layer: int) -> tuple[str, str]:
        """(gate_up [E, 2I, D], down [E, D, I]) tensor names of a sparse layer in the fused layout."""
        sp = families.fused_expert_tensors(self.config, layer)
        return sp["gate_up"][0], sp["down"][0]

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        i, d = self.intermediate_size, self.hidden_size
        return (i, d), (i, d), (d, i)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def layout_from_config(cfg: dict[str, Any]) -> MoeLayout:
    """The MoE layout described by a Hugging Face ``config.json`` dict; raises :class:`LayoutError`."""
    try:
        mc = ModelConfig.from_hf(cfg)
    except ConfigError as e:
        raise LayoutError(str(e)) from None
    if not mc.is_moe:
        raise LayoutError(f"model_type {mc.model_type!r} is dense: it has no routed experts to hold")
    sparse = tuple(i for i in range(mc.num_layers) if mc.is_sparse(i))
    return MoeLayout(family=mc.model_type, num_layers=mc.num_layers, num_experts=mc.num_experts,
                     hidden_size=mc.hidden_size, intermediate_size=mc.moe_intermediate_size, top_k=mc.top_k,
                     norm_topk_prob=mc.norm_topk_prob, sparse_layers=sparse, config=mc)


def read_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict (for a ``.gguf``: its metadata as such a dict); raises
    :class:`LayoutError` with a readable reason."""
    from engine.gguf_file import is_gguf, load_gguf

    if is_gguf(path):
        from engine.checkpoint import CheckpointError

        try:
            return load_gguf(path).hf_config
        except CheckpointError as e:
            raise LayoutError(str(e)) from None
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{path} has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"{path}/config.json is unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"{path}/config.json is not a JSON object")
    return cfg
