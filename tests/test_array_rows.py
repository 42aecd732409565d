"""Audit rows and recipes are stored as msgpack arrays; rows stored as maps still read."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest

from torpor import CorruptEvent, UserMessage
from torpor.compaction.recipe import Recipe, decode_recipe, encode_recipe
from torpor.store import ModelCall, open_store
from torpor.store.rows import decode_model_call, encode_model_call

RECIPE = Recipe(
    checkpoint_position=3, cycle=1, tail_start=3, tail_end=9, stubbed=(4,), clipped=((5, 80),),
    system_hash="ab" * 32, tools=("recall", "expand"), turn=4, pushed=((1, 20),),
)
CALL = ModelCall(
    "conv", 4, 1, 1, encode_recipe(RECIPE), "cd" * 32,
    {"system": 10, "markers": 0, "tools": 259, "tail": 24, "tool_results": 0, "user": 5},
    298, 0.0024, completion_tokens=3, latency_ms=0.02, ttft_ms=0.01, created_at=1_795_483_124_289,
    model="echo", turn_id="01M85J4GJ1000000T3WFHZ4GRT", events_in_context=5, markers=0,
    topic="ping", topic_changed=False,
)


def test_a_call_and_its_recipe_round_trip_as_arrays_less_than_half_the_size() -> None:
    data = encode_model_call(CALL)
    assert data[0] == 0xDC  # an array (16 or more fields)
    assert decode_model_call("conv", 4, data) == CALL
    assert decode_recipe(CALL.recipe) == RECIPE and CALL.recipe[0] == 0xDC
    as_maps = msgspec.msgpack.encode(
        msgspec.structs.replace(CALL, recipe=msgspec.msgpack.encode(RECIPE))
    )
    assert len(data) < len(as_maps) / 2


def test_rows_stored_as_maps_before_still_decode() -> None:
    old_recipe = msgspec.msgpack.encode(RECIPE)
    old_call = msgspec.msgpack.encode(msgspec.structs.replace(CALL, recipe=old_recipe))
    assert old_call[0] == 0xDE and old_recipe[0] == 0xDE  # maps
    call = decode_model_call("conv", 4, old_call)
    assert msgspec.structs.replace(call, recipe=CALL.recipe) == CALL
    assert decode_recipe(call.recipe) == RECIPE


def test_a_shorter_array_from_before_a_field_was_added_takes_the_defaults() -> None:
    fields = msgspec.structs.astuple(CALL)
    older = msgspec.msgpack.encode(fields[:19])  # up to ``purpose``: no anatomy, no push
    call = decode_model_call("conv", 4, older)
    assert call.turn_id == "" and call.topic is None and call.pushed == ()
    assert call.sections == CALL.sections and call.model == "echo"


@pytest.mark.parametrize("data", [b"", b"\x93\x01", b"\xdc\x00\x02\xa1x\x01", b"\xff"])
def test_a_row_that_does_not_decode_is_a_corrupt_event(data: bytes) -> None:
    with pytest.raises(CorruptEvent):
        decode_model_call("conv", 4, data)


async def test_a_database_with_map_rows_reads_them_beside_new_array_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    async with open_store(url) as store:
        await store.append(CALL.conversation_id, [UserMessage("x")])  # creates it
        await store.record_model_call(CALL)
    old = msgspec.msgpack.encode(msgspec.structs.replace(CALL, turn=5))
    with sqlite3.connect(tmp_path / "log.db") as conn:  # a row as an earlier version wrote it
        conn.execute(
            "INSERT INTO model_calls (conversation_id, turn, call_index, created_at, body) "
            "SELECT conversation_id, 5, 1, created_at, ? FROM model_calls", (old,)
        )
    async with open_store(url) as store:
        calls = await store.model_calls("conv")
    assert [c.turn for c in calls] == [4, 5]
    assert calls[0] == CALL and calls[1] == msgspec.structs.replace(CALL, turn=5)
