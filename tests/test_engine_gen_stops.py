"""Stop strings as a property: for any token texts and stop strings, the emitted text is the text up to
the first stop found after each token, and nothing past that point is ever emitted, even partly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.generate import DecodeState
from engine.sampling import SamplingParams


class _PieceDetok:
    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


class _PieceTokenizer:
    """Token i decodes to pieces[i]; no eos."""

    eos_ids: frozenset[int] = frozenset()

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = pieces

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> _PieceDetok:
        return _PieceDetok(self.pieces)


def _reference(pieces: list[str], stops: list[str]) -> tuple[str, int]:
    text = ""
    for n, p in enumerate(pieces, 1):
        text += p
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], n
    return text, len(pieces)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet="ab\u00e9", max_size=3), min_size=1, max_size=12),
       st.lists(st.text(alphabet="ab\u00e9", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_property(pieces: list[str], stops: list[str]) -> None:
    tok = _PieceTokenizer(pieces)
    params = SamplingParams(max_tokens=len(pieces), stop=tuple(stops))
    state = DecodeState(tok, [0], params, None)  # type: ignore[arg-type]
    want_text, want_n = _reference(pieces, stops)
    emitted, n = "", 0
    for i in range(len(pieces)):
        logits = np.full(len(pieces), -10.0, dtype=np.float32)
        logits[i] = 10.0  # greedy picks token i
        ev = state.step(logits)
        n += 1
        emitted += ev.text
        assert want_text.startswith(emitted)  # never past the stop, never part of it
        if ev.finish_reason is not None:
            break
    assert emitted == want_text and n == want_n
    assert ev.finish_reason == ("stop" if any(s in "".join(pieces[:n]) for s in stops) else "length")
