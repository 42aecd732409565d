"""admit_model_call's one-expression path for the runtime's own rows agrees with the full check.

The fast path may only say "unchanged": for any row it accepts, the full check
must accept the row as it is too; whatever it refuses goes through the full
check, which raises or repairs as before.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from torpor import InvalidInput
from torpor.store import ModelCall
from torpor.store.admit import _admitted, _plain, admit_model_call

_ints = st.one_of(
    st.integers(min_value=-3, max_value=5),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1]),
    st.booleans(),
    st.floats(allow_nan=False, min_value=-1, max_value=3),
    st.none(),
    st.text(max_size=2),
)
_texts = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "a\x00b", "\ud800", "é", "x" * 257]),
    st.integers(0, 2),
    st.none(),
)


@st.composite
def _rows(draw: st.DrawFn) -> ModelCall:
    fields: dict[str, Any] = {
        "conversation_id": draw(_texts),
        "turn": draw(_ints),
        "call_index": draw(_ints),
        "compaction_cycle": draw(_ints),
        "recipe": draw(st.one_of(st.binary(max_size=4), st.text(max_size=2))),
        "rendered_hash": draw(_texts),
        "sections": draw(st.one_of(
            st.dictionaries(_texts, _ints, max_size=3), st.lists(st.integers(), max_size=2)
        )),
        "estimated_prompt_tokens": draw(_ints),
        "utilization": draw(_ints),
        "reported_prompt_tokens": draw(_ints),
        "completion_tokens": draw(_ints),
        "latency_ms": draw(_ints),
        "ttft_ms": draw(_ints),
        "created_at": draw(_ints),
        "model": draw(_texts),
        "error": draw(_texts),
        "cache_read_tokens": draw(_ints),
        "cache_write_tokens": draw(_ints),
        "purpose": draw(_texts),
    }
    return ModelCall(**fields)  # msgspec does not check types when a Struct is built


@settings(max_examples=600, deadline=None)
@given(_rows())
def test_the_fast_path_accepts_only_what_the_full_check_keeps_as_it_is(call: ModelCall) -> None:
    try:
        full: ModelCall | None = _admitted(call)
    except InvalidInput:
        full = None
    except TypeError:  # e.g. unhashable section names: the full check's own failure
        full = None
    if _plain(call):
        assert full is call
    else:
        try:
            assert admit_model_call(call) == full
        except (InvalidInput, TypeError):
            assert full is None


def test_the_runtime_shaped_row_takes_the_fast_path() -> None:
    call = ModelCall(
        "c", 1, 1, 0, b"\x90", "h", {"system": 3, "tail": 5}, 8, 0.1,
        reported_prompt_tokens=9, latency_ms=1.5, ttft_ms=None, created_at=1, model="echo",
    )
    assert _plain(call)
    assert admit_model_call(call) is call
