"""Record fields for the mesh view: load, free memory, API address and fields this version does not know
(a newer node's, say ``future``) survive signing and verification; when a load change is worth a re-sign."""

from __future__ import annotations

import json

import pytest

from meshd.membership.load import LOAD_MIN_INTERVAL_S, load_changed, load_interval_s
from meshd.membership.records import (
    Capacity,
    LocalInfo,
    Load,
    ModelInfo,
    RecordError,
    RecordVerifier,
    StageOffer,
    sign_record,
)
from transport.credentials import canonical_json, create_mesh
from transport.identity import NodeIdentity


def _mesh():  # type: ignore[no-untyped-def]
    ident = NodeIdentity.generate()
    creds = create_mesh(ident, "t", 1, 1, 1)
    return ident, creds, RecordVerifier(creds.genesis)


def test_load_api_and_unknown_fields_round_trip() -> None:
    ident, creds, verifier = _mesh()
    future = [{"model_fp": "abc", "layers": [0, 11]}]
    offer = StageOffer("abc", 4096, (0, 11))  # the pipeline's own field is known and checked
    info = LocalInfo(addrs=("127.0.0.1:1",), models=(ModelInfo("m", "engine", "fp", 4096),),
                     capacity=Capacity(8, 32000, 3, 1234), load=Load(2, 17.5, 4), api="127.0.0.1:9337",
                     stages=(offer,), extra=(("future", future),))
    rec = verifier.decode_record(sign_record(ident, creds, info, 7))
    assert rec.capacity == Capacity(8, 32000, 3, 1234) and rec.load == Load(2, 17.5, 4)
    assert rec.api == "127.0.0.1:9337" and rec.extra == {"future": future} and rec.stages == (offer,)
    view = rec.to_json()
    assert view["future"] == future and view["load"] == {"queue": 2, "tok_s": 17.5, "slots": 4}
    assert view["stages"] == [offer.to_json()]


def test_a_record_without_the_new_fields_still_verifies() -> None:
    """Records of nodes that predate load/free_mb (format version 1 unchanged) are accepted."""
    ident, creds, verifier = _mesh()
    data = json.loads(sign_record(ident, creds, LocalInfo(addrs=("h:1",)), 1))
    body = data["body"]
    del body["load"]
    del body["cap"]["free_mb"]
    from transport.credentials import b64e

    data = canonical_json({"body": body, "sig": b64e(ident.sign(b"node-record", canonical_json(body)))})
    rec = verifier.decode_record(data)
    assert rec.load == Load() and rec.capacity.free_mb == 0 and rec.extra == {}


@pytest.mark.parametrize("load", [{"queue": 1, "tok_s": -1, "slots": 1}, {"queue": 1, "tok_s": "x", "slots": 1},
                                  {"queue": -1, "tok_s": 0, "slots": 1}, {"queue": 1}])
def test_bad_load_is_rejected(load) -> None:  # type: ignore[no-untyped-def]
    ident, creds, verifier = _mesh()
    data = json.loads(sign_record(ident, creds, LocalInfo(addrs=("h:1",)), 1))
    body = data["body"]
    body["load"] = load
    from transport.credentials import b64e

    blob = canonical_json({"body": body, "sig": b64e(ident.sign(b"node-record", canonical_json(body)))})
    with pytest.raises(RecordError):
        verifier.decode_record(blob)


def test_load_changed_only_when_material() -> None:
    cap, load = Capacity(2, 100, 1, 1000), Load(0, 10.0, 4)
    assert not load_changed(cap, load, cap, load)
    assert load_changed(cap, load, Capacity(2, 100, 2, 1000), load)  # one more in flight
    assert load_changed(cap, load, cap, Load(1, 10.0, 4))  # one waiting
    assert not load_changed(cap, load, cap, Load(0, 11.0, 4))  # tokens/s within 25 %
    assert load_changed(cap, load, cap, Load(0, 14.0, 4))
    assert not load_changed(cap, load, Capacity(2, 100, 1, 1050), load)  # free memory within 10 %
    assert load_changed(cap, load, Capacity(2, 100, 1, 800), load)


def test_load_interval_grows_with_the_mesh_so_mesh_wide_resigns_shrink() -> None:
    assert load_interval_s(1, 200) == LOAD_MIN_INTERVAL_S  # never more often than this
    rates = [n / load_interval_s(n, 800) for n in (10, 100, 1000)]  # mesh-wide load re-signs per second
    assert rates[0] > rates[1] > rates[2]
    assert load_interval_s(100, 1600) == pytest.approx(2 * load_interval_s(100, 800))
