"""The anatomy record of every model call (design source 001, Annex A.4): events and
markers in context, a topic label and whether it changed, a time-sortable turn id;
and old audit rows, written before these fields, still decode."""

from __future__ import annotations

import hashlib

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor import AgentConfig, Runtime
from torpor.compaction.anatomy import events_in_context, topic_label, turn_id
from torpor.compaction.markers import encode_hints, hints_of, rank_topics
from torpor.events import Event, UserMessage
from torpor.llm.echo import EchoModel
from torpor.llm.protocol import SystemMessage
from torpor.store.protocol import ModelCall
from torpor.store.rows import decode_model_call

# Words, paths, identifiers, numbers with units, acronyms, quotes: every kind of hint.
_LABEL_ALPHABET = [
    "deploy ", "the ", "Kubernetes ", "src/app.py ", "`make` ", "x=3 ", "10ms ", "NASA ",
    "invoice ", "billing ", "\"quoted\" ", "https://a.io/x ", "ping ", "and ", "API ", "é ",
]


def test_turn_ids_sort_by_time_and_name_one_turn() -> None:
    a = turn_id(1_700_000_000_000, "c", 1)
    b = turn_id(1_700_000_000_001, "c", 2)
    assert len(a) == 26 and a < b
    assert a == turn_id(1_700_000_000_000, "c", 1) != turn_id(1_700_000_000_000, "d", 1)
    assert sorted([turn_id(ms, "x", ms) for ms in (5, 3_000_000_000_000, 40)]) == [
        turn_id(ms, "x", ms) for ms in (5, 40, 3_000_000_000_000)
    ]


def test_turn_ids_stay_the_ids_earlier_versions_stored() -> None:
    # Audit rows keep them: a turn spanning an upgrade must keep its id.
    assert turn_id(1_700_000_000_000, "c", 1) == "01HF7YAT00000000EV910HC0Y6"
    assert turn_id(0, "x", 0) == "00000000000000002BW2YKJGGE"
    assert turn_id(2**48 - 1, "conv", 2**32 - 1) == "7ZZZZZZZZZZZZZZZWA4BG2CGY2"


def test_turn_id_is_crockford_base32_of_time_turn_and_hash() -> None:
    crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    for ms, turn in ((0, 0), (1_700_000_000_000, 1), ((1 << 48) - 1, (1 << 32) - 1), (5, 77)):
        text = turn_id(ms, "conv", turn)
        value = 0
        for char in text:
            value = value * 32 + crockford.index(char)
        assert value < 1 << 128  # the first character holds the top 3 bits only
        assert value >> 80 == ms and (value >> 48) & 0xFFFFFFFF == turn
        digest = hashlib.blake2b(f"conv\0{turn}".encode(), digest_size=6).digest()
        assert value & ((1 << 48) - 1) == int.from_bytes(digest, "big")


def test_topic_label_is_the_current_turns_best_hint() -> None:
    tail = [
        Event("c", 0, 1, 0, 0, UserMessage("look at deploy/nginx/ssl.conf please")),
        Event("c", 1, 2, 0, 0, UserMessage("and now src/billing/invoice.py")),
    ]
    assert topic_label(tail) == "src/billing/invoice.py"
    assert topic_label(tail[:1]) == "deploy/nginx/ssl.conf"
    assert topic_label([]) is None
    assert events_in_context([SystemMessage("s"), UserMessage("u")]) == 1


async def test_every_call_records_its_anatomy() -> None:
    config = AgentConfig(model=EchoModel(), system_prompt="Be brief.")
    async with Runtime("sqlite://", agent=config) as rt:
        for text in (
            "please read deploy/nginx/ssl.conf",
            "and deploy/nginx/ssl.conf again",
            "now look at src/billing/invoice.py",
        ):
            await (await rt.send("c", text)).result()
        calls = await rt.store.model_calls("c")
    turns = [c for c in calls if c.purpose == "turn"]
    assert len(turns) == 3
    assert [c.topic for c in turns] == [
        "deploy/nginx/ssl.conf",
        "deploy/nginx/ssl.conf",
        "src/billing/invoice.py",
    ]
    assert [c.topic_changed for c in turns] == [False, False, True]
    assert [c.events_in_context for c in turns] == [1, 3, 5]
    assert all(c.markers == 0 for c in turns)
    ids = [c.turn_id for c in turns]
    assert all(len(i) == 26 for i in ids) and ids == sorted(ids) and len(set(ids)) == 3


class _OldModelCall(msgspec.Struct, frozen=True, gc=False):
    """ModelCall as rows were written before the anatomy fields."""

    conversation_id: str
    turn: int
    call_index: int
    compaction_cycle: int
    recipe: bytes
    rendered_hash: str
    sections: dict[str, int]
    estimated_prompt_tokens: int
    utilization: float
    reported_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None
    created_at: int = 0
    model: str = ""
    error: str | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    purpose: str = "turn"


def test_rows_written_before_the_anatomy_fields_still_decode() -> None:
    old = _OldModelCall("c", 1, 0, 0, b"", "h", {"system": 3}, 10, 0.1)
    call = decode_model_call("c", 1, msgspec.msgpack.encode(old))
    assert isinstance(call, ModelCall) and call.sections == {"system": 3}
    assert call.turn_id == "" and call.events_in_context is None and call.markers is None
    assert call.topic is None and call.topic_changed is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_LABEL_ALPHABET), max_size=12).map("".join),
                min_size=1, max_size=3))
def test_a_one_event_turn_is_labelled_as_ranking_it_would(texts: list[str]) -> None:
    """The label's shortcut for a turn of one event (no background) equals the ranking."""
    tail = [Event("c", i, i + 1, 0, 0, UserMessage(t), encode_hints(UserMessage(t)))
            for i, t in enumerate(texts)]
    span = [tail[-1]]
    ranked = rank_topics((hints_of(e) for e in span), 1, None, 1)
    if ranked:
        assert topic_label(tail) == ranked[0]
    else:  # falls back to the recent tail, as the ranking path does
        fallback = rank_topics((hints_of(e) for e in tail), 1, None, len(tail))
        assert topic_label(tail) == (fallback[0] if fallback else None)
