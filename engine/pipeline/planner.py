"""Pipeline placement: which node holds which contiguous layers. A pure function of what gossip says.

``make_plan(need, local, offers)`` -> ``Plan`` or raises ``PlanError`` (the reason names what is missing).
Rules, in order:

1. An offer for another checkpoint (fingerprint) is refused by name (``Plan.refused``); so is one whose
   numerics tag (engine/numerics.py) is not the serving node's (an offer without one, from an older meshd, is
   used as before: there is nothing to check), and a pin
   outside the model's layers. Pins that overlap each other fail the plan, naming both nodes.
2. The serving node (``local``) always comes first: it holds the embeddings and layers ``0..a-1`` (a may
   be 0 when a pin starts at layer 0). The last range's holder also holds the final norm and output head.
3. Every pinned offer is used with exactly its range. The layers between pins are filled with the fewest
   unpinned offers that fit (bytes of their layers, plus the head for the last, within free memory);
   the prefix before the first pin goes to the serving node first.
4. Among sets of equally few offers, the one whose hops cost least is taken: cost of an offer is its
   measured round trip plus the time to move one token's activations both ways at its measured bandwidth
   (unknown counts as ``DEFAULT_RTT_S`` / ``DEFAULT_BANDWIDTH_BPS``); ties go to more free memory, then
   node id. Within a gap, ranges are in proportion to free memory (largest remainders), then shifted so
   each fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.numerics import difference

DEFAULT_RTT_S = 0.005  # an offer with no measured round trip yet (a LAN hop)
DEFAULT_BANDWIDTH_BPS = 100e6  # ...and no measured bandwidth (a LAN link, bytes/s)
MAX_COMBINATIONS = 20000  # offer subsets tried per gap before taking the cheapest found


class PlanError(Exception):
    """No plan: ``reason`` says what is missing (shown in the 503 and in status)."""

    def __init__(self, reason: str, refused: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused  # offers left out (another checkpoint, a pin outside the model)


@dataclass(frozen=True, slots=True)
class Need:
    """What the model needs: per-layer weight bytes, the output head's bytes, and one token's activation
    bytes (hidden size x 4)."""

    fingerprint: str
    layer_bytes: tuple[int, ...]
    head_bytes: int
    token_bytes: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    def span_bytes(self, first: int, last: int, head: bool) -> int:
        return sum(self.layer_bytes[first : last + 1]) + (self.head_bytes if head else 0)


@dataclass(frozen=True, slots=True)
class Offer:
    """A node offering to hold layers: from gossip (``stages`` of its record) and the transport's path
    measurements. ``pin`` is (first, last) for ``--stage PATH@FIRST-LAST``."""

    node_id: str
    fingerprint: str
    free_bytes: int
    pin: tuple[int, int] | None = None
    rtt_s: float | None = None
    bandwidth_bps: float | None = None
    numerics: str | None = None  # the node's numerics tag (gossip ``numerics``); None: it says none

    def cost_s(self, token_bytes: int) -> float:
        rtt = self.rtt_s if self.rtt_s is not None else DEFAULT_RTT_S
        bw = self.bandwidth_bps if self.bandwidth_bps else DEFAULT_BANDWIDTH_BPS
        return rtt + 2 * token_bytes / bw


@dataclass(frozen=True, slots=True)
class Stage:
    node_id: str
    first: int  # first > last: holds no layers (the serving node when a pin starts at layer 0)
    last: int

    @property
    def layers(self) -> int:
        return max(0, self.last - self.first + 1)


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[Stage, ...]  # stages[0] is the serving node
    refused: tuple[tuple[str, str], ...] = field(default=())  # (node id, reason)

    @property
    def local_only(self) -> bool:
        return len(self.stages) == 1

    def describe(self) -> list[dict[str, object]]:
        return [
            {"node_id": s.node_id, "layers": [s.first, s.last] if s.layers else None} for s in self.stages
        ]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _split(
    need: Need, first: int, last: int, holders: list[tuple[str, int]], head_at_end: bool
) -> list[Stage] | None:
    """Layers first..last over holders (node, free bytes) in order, in proportion to free memory, each
    holding at least one layer and fitting; None if no such split exists."""
    n = last - first + 1
    k = len(holders)
    if k > n:
        return None
    total = sum(f for _, f in holders) or 1
    # proportional counts by largest remainders, at least 1 each
    raw = [n * f / total for _, f in holders]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) > n:
        i = max((j for j in range(k) if counts[j] > 1), key=lambda j: counts[j] - raw[j])
        counts[i] -= 1
    order = sorted(range(k), key=lambda j: raw[j] - int(raw[j]), reverse=True)
    for j in itertools.islice(itertools.cycle(order), n - sum(counts)):
        counts[j] += 1
    # shift layers from holders that overflow to neighbours with room (a few passes suffice)
    for _ in range(n * k + 1):
        cuts, pos = [], first
        for c in counts:
            cuts.append((pos, pos + c - 1))
            pos += c
        over = [
            j
            for j, (a, b) in enumerate(cuts)
            if need.span_bytes(a, b, head_at_end and j == k - 1) > holders[j][1]
        ]
        if not over:
            return [Stage(holders[j][0], a, b) for j, (a, b) in enumerate(cuts)]
        j = over[0]
        if counts[j] == 1:
            return None
        room = [
            i
            for i in range(k)
            if i != j and need.span_bytes(*_grow(cuts, i, j), head_at_end and i == k - 1) <= holders[i][1]
        ]
        if not room:
            return None
        i = min(room, key=lambda i: abs(i - j))
        counts[j] -= 1
        counts[i] += 1
    return None


def _grow(cuts: list[tuple[int, int]], i: int, _j: int) -> tuple[int, int]:
    a, b = cuts[i]
    return a, b + 1


def _fill(
    need: Need, first: int, last: int, lead: tuple[str, int] | None, pool: list[Offer], head_at_end: bool
) -> tuple[list[Stage], list[Offer]]:
    """Fill one gap with the fewest, cheapest offers from ``pool`` (after ``lead``, the serving node, for
    the prefix). -> (stages, offers used). Raises ``PlanError``."""
    ranked = sorted(pool, key=lambda o: (o.cost_s(need.token_bytes), -o.free_bytes, o.node_id))
    for k in range(len(ranked) + 1):
        best: tuple[float, list[Stage], list[Offer]] | None = None
        for tried, combo in enumerate(itertools.combinations(ranked, k)):
            if tried >= MAX_COMBINATIONS:
                break
            # the serving node takes part of the prefix if it has room for a layer; else it only embeds
            for leads in ([lead], []) if lead is not None else ([],):
                holders = leads + [(o.node_id, o.free_bytes) for o in combo]
                stages = _split(need, first, last, holders, head_at_end) if holders else None
                if stages is not None:
                    if lead is not None and not leads:
                        stages = [Stage(lead[0], 0, -1), *stages]
                    break
            if stages is None:
                continue
            cost = sum(o.cost_s(need.token_bytes) for o in combo)
            if best is None or cost < best[0]:
                best = (cost, stages, list(combo))
        if best is not None:
            return best[1], best[2]
    have = (lead[1] if lead else 0) + sum(o.free_bytes for o in pool)
    want = need.span_bytes(first, last, head_at_end)
    raise PlanError(
        f"layers {first}-{last} need {_mb(want)}{' with the output head' if head_at_end else ''}; "
        f"{'this node and ' if lead else ''}{len(pool)} stage node(s) offer {_mb(have)} "
        f"({_mb(max(0, want - have))} missing, or no split fits each node's free memory)"
    )


def make_plan(need: Need, local: Offer, offers: list[Offer]) -> Plan:
    """See the module docstring. ``local`` is the serving node (its ``pin`` is ignored). A ``PlanError``
    carries the refusals too."""
    refused: list[tuple[str, str]] = []
    try:
        return _make_plan(need, local, offers, refused)
    except PlanError as e:
        raise PlanError(e.reason, tuple(refused)) from None


def _make_plan(need: Need, local: Offer, offers: list[Offer], refused: list[tuple[str, str]]) -> Plan:
    n = need.num_layers
    usable: list[Offer] = []
    # a stage node may hold several checkpoints (--stage is repeatable): its offers of other ones are not
    # refusals when it also offers this one
    holders = {o.node_id for o in offers if o.fingerprint == need.fingerprint}
    taken: set[str] = set()  # nodes whose offer of this checkpoint is used: one per node (a stage node
    # serves a run's steps by run id, so two ranges of one run on one node cannot be told apart)
    for o in sorted(offers, key=lambda o: o.node_id):
        if o.node_id == local.node_id:
            continue
        if o.fingerprint == need.fingerprint and o.node_id in taken:
            again = f" (layers {o.pin[0]}-{o.pin[1]})" if o.pin else ""
            why = f"stage {o.node_id[:12]} offers this checkpoint again{again}: one range per node is used"
            refused.append((o.node_id, why))
            continue
        if o.fingerprint != need.fingerprint:
            if o.node_id in holders:
                continue
            refused.append(
                (
                    o.node_id,
                    (
                        f"stage {o.node_id[:12]} holds checkpoint {o.fingerprint[:16]}, "
                        f"not {need.fingerprint[:16]}"
                    ),
                )
            )
        elif o.numerics is not None and local.numerics is not None and o.numerics != local.numerics:
            why = difference(local.numerics, o.numerics, "on this node", "on the stage")
            refused.append((o.node_id, f"stage {o.node_id[:12]} computes with other numerics: {why}"))
        elif o.pin is not None and not 0 <= o.pin[0] <= o.pin[1] < n:
            refused.append(
                (
                    o.node_id,
                    f"stage {o.node_id[:12]} pins layers {o.pin[0]}-{o.pin[1]}, the model has 0-{n - 1}",
                )
            )
        else:
            usable.append(o)
            taken.add(o.node_id)
    pinned = sorted((o for o in usable if o.pin is not None), key=lambda o: o.pin)  # type: ignore[arg-type,return-value]
    for a, b in itertools.pairwise(pinned):
        assert a.pin is not None and b.pin is not None
        if b.pin[0] <= a.pin[1]:
            raise PlanError(
                f"pins overlap: stage {a.node_id[:12]} holds {a.pin[0]}-{a.pin[1]} and stage "
                f"{b.node_id[:12]} holds {b.pin[0]}-{b.pin[1]}"
            )
    for o in pinned:
        assert o.pin is not None
        if need.span_bytes(o.pin[0], o.pin[1], o.pin[1] == n - 1) > o.free_bytes:
            raise PlanError(
                f"stage {o.node_id[:12]} pins layers {o.pin[0]}-{o.pin[1]} but offers only "
                f"{_mb(o.free_bytes)}"
            )
    pool = [o for o in usable if o.pin is None]
    stages: list[Stage] = []
    pos = 0
    for o in [*pinned, None]:
        end = o.pin[0] - 1 if o is not None and o.pin is not None else n - 1
        if end >= pos:
            lead = (local.node_id, local.free_bytes) if pos == 0 else None
            got, used = _fill(need, pos, end, lead, pool, o is None)
            stages.extend(got)
            pool = [p for p in pool if p not in used]
        elif pos == 0:
            stages.append(Stage(local.node_id, 0, -1))  # a pin starts at layer 0: this node only embeds
        if o is not None and o.pin is not None:
            stages.append(Stage(o.node_id, o.pin[0], o.pin[1]))
            pos = o.pin[1] + 1
    return Plan(tuple(stages), tuple(refused))
