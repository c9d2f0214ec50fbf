"""The pipeline planner, from a table: fewest stages, proportional ranges, cheapest hops, pins, refusals."""

from __future__ import annotations

import pytest

from engine.pipeline.planner import Need, Offer, PlanError, make_plan

FP = "aa" * 32
MB = 1_000_000


def need(layers: int = 8, layer_mb: float = 1.0, head_mb: float = 0.5) -> Need:
    return Need(FP, tuple(int(layer_mb * MB) for _ in range(layers)), int(head_mb * MB), 4096)


def me(free_mb: float) -> Offer:
    return Offer("local", FP, int(free_mb * MB))


def off(
    node: str, free_mb: float, pin: tuple[int, int] | None = None, rtt_ms: float | None = None, fp: str = FP
) -> Offer:
    return Offer(node, fp, int(free_mb * MB), pin, rtt_ms / 1e3 if rtt_ms is not None else None)


def ranges(plan) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(s.node_id, s.first, s.last) for s in plan.stages]


TABLE = [
    # (case, local MB, offers, expected stages)
    ("fits here: one stage", 100, [off("a", 100)], [("local", 0, 7)]),
    ("one stage node, equal memory: half each", 4.5, [off("a", 4.5)], [("local", 0, 3), ("a", 4, 7)]),
    ("proportional to free memory", 2, [off("a", 7)], [("local", 0, 1), ("a", 2, 7)]),
    (
        "fewest stages: the big node alone",
        3,
        [off("a", 2), off("b", 9), off("c", 2)],
        [("local", 0, 1), ("b", 2, 7)],
    ),
    (
        "three stages when two do not fit",
        3,
        [off("a", 3), off("b", 3.5)],
        [("local", 0, 2), ("b", 3, 5), ("a", 6, 7)],
    ),
    (
        "cheapest hop among equals",
        4.5,
        [off("far", 5, rtt_ms=20), off("near", 5, rtt_ms=0.2)],
        [("local", 0, 3), ("near", 4, 7)],
    ),
    ("a pin is used as given", 100, [off("a", 100, pin=(5, 7))], [("local", 0, 4), ("a", 5, 7)]),
    (
        "pin at layer 0: this node only embeds",
        1,
        [off("a", 100, pin=(0, 7))],
        [("local", 0, -1), ("a", 0, 7)],
    ),
    (
        "gap after a pin filled by an unpinned node",
        2.5,
        [off("p", 3, pin=(2, 3)), off("u", 10)],
        [("local", 0, 1), ("p", 2, 3), ("u", 4, 7)],
    ),
    (
        "another checkpoint is not used",
        4.5,
        [off("x", 100, fp="bb" * 32), off("a", 4.5)],
        [("local", 0, 3), ("a", 4, 7)],
    ),
]


@pytest.mark.parametrize(("case", "local", "offers", "want"), TABLE, ids=[t[0] for t in TABLE])
def test_plan_table(case: str, local: float, offers: list[Offer], want: list[tuple[str, int, int]]) -> None:
    plan = make_plan(need(), me(local), offers)
    assert ranges(plan) == want
    n = need()
    for s in plan.stages[1:]:  # every stage fits its free memory
        o = next(x for x in offers if x.node_id == s.node_id)
        assert n.span_bytes(s.first, s.last, s.last == 7) <= o.free_bytes


def test_other_checkpoint_is_refused_by_name() -> None:
    plan = make_plan(need(), me(100), [off("node-x-123456", 100, fp="bb" * 32)])
    assert plan.refused and plan.refused[0][0] == "node-x-123456"
    assert "node-x-1234" in plan.refused[0][1] and "bbbbbbbb" in plan.refused[0][1]


def test_a_stage_node_holding_this_and_another_checkpoint_is_used_not_refused() -> None:
    # `meshd serve --stage A@4-7 --stage B@4-7` gossips one offer per checkpoint: planning A, the offer of
    # B is no refusal (status showed the node planned and refused at once)
    offers = [off("x", 100, pin=(4, 7), fp="bb" * 32), off("x", 100, pin=(4, 7)), off("y", 100, fp="cc" * 32)]
    plan = make_plan(need(), me(100), offers)
    assert ranges(plan) == [("local", 0, 3), ("x", 4, 7)]
    assert [n for n, _ in plan.refused] == ["y"]


def test_a_second_offer_of_this_checkpoint_from_one_node_is_refused_not_planned() -> None:
    # `--stage ck@0-1 --stage ck@2-3` on one node: both ranges in one run reached the node's first host
    # ("pinned to layers 0-1, asked for 2-3") and the serving node fell back to running alone
    offers = [off("x", 100, pin=(4, 7)), off("x", 100, pin=(0, 3))]
    plan = make_plan(need(), me(100), offers)
    assert ranges(plan) == [("local", 0, 3), ("x", 4, 7)]
    assert [n for n, _ in plan.refused] == ["x"] and "again (layers 0-3)" in plan.refused[0][1]


@pytest.mark.parametrize(
    ("offers", "reason"),
    [
        (
            [off("a", 100, pin=(2, 5)), off("b", 100, pin=(5, 7))],
            "pins overlap: stage a holds 2-5 and stage b holds 5-7",
        ),
        ([off("a", 1, pin=(2, 5))], "stage a pins layers 2-5 but offers only 1.0 MB"),
        (
            [],
            "layers 0-7 need 8.5 MB with the output head; this node and 0 stage node(s) offer 2.0 MB (6.5 MB missing",
        ),
        ([off("a", 2)], "offer 4.0 MB (4.5 MB missing"),
    ],
)
def test_refused_plans_say_why(offers: list[Offer], reason: str) -> None:
    with pytest.raises(PlanError) as e:
        make_plan(need(), me(2), offers)
    assert reason in e.value.reason


def test_pin_outside_the_model_is_refused_not_fatal() -> None:
    plan = make_plan(need(), me(100), [off("a", 100, pin=(6, 9))])
    assert ranges(plan) == [("local", 0, 7)]
    assert "has 0-7" in plan.refused[0][1]


def test_a_failed_plan_still_names_refused_stages() -> None:
    with pytest.raises(PlanError) as e:
        make_plan(
            need(), me(2), [off("x", 100, fp="bb" * 32), off("a", 100, pin=(2, 5)), off("b", 100, pin=(4, 7))]
        )
    assert "pins overlap" in e.value.reason and [n for n, _ in e.value.refused] == ["x"]


def test_a_serving_node_without_room_for_a_layer_only_embeds() -> None:
    plan = make_plan(need(), me(0.5), [off("a", 20)])
    assert ranges(plan) == [("local", 0, -1), ("a", 0, 7)]
