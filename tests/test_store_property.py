"""Property: after any interleaving of appends and checkpoints, the tail is a suffix of the log.

A contract: runs on each backend (see store_backends.py). Examples share the
backend's database, so each plays on conversations of its own.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_backends import Backend

from torpor.errors import UnknownConversation
from torpor.events import Aborted, AssistantMessage, ToolResult, UserMessage
from torpor.store import Checkpoint

# What the log can hold: no NUL, no lone surrogates; ids non-empty.
storable = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
text = st.text(storable, max_size=40)
call_id = st.text(storable, min_size=1, max_size=5)
bodies = st.one_of(
    st.builds(UserMessage, text),
    st.builds(AssistantMessage, text),
    st.builds(ToolResult, call_id, st.just("tool"), text),
    st.builds(Aborted, st.sampled_from(["cancelled", "crashed", "model_error"])),
)
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("append"), st.sampled_from("ab"), st.lists(bodies, min_size=1, max_size=4)
        ),
        st.tuples(st.just("checkpoint"), st.sampled_from("ab"), st.floats(0, 1)),
    ),
    max_size=25,
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps)
def test_read_since_latest_checkpoint_is_the_suffix_of_the_full_log(
    any_backend: Backend, script: list[tuple[str, str, object]]
) -> None:
    asyncio.run(_play(any_backend, script))


async def _play(backend: Backend, script: list[tuple[str, str, object]]) -> None:
    run = uuid.uuid4().hex[:8]
    async with backend.open() as store:
        expected: dict[str, list[object]] = {f"{run}-a": [], f"{run}-b": []}
        for action, name, arg in script:
            conv = f"{run}-{name}"
            if action == "append":
                assert isinstance(arg, list)
                positions = await store.append(conv, arg)
                assert positions == list(range(len(expected[conv]), len(expected[conv]) + len(arg)))
                expected[conv].extend(arg)
            else:
                assert isinstance(arg, float)
                position = round(arg * len(expected[conv]))
                if not expected[conv]:  # only an append creates a conversation
                    with pytest.raises(UnknownConversation):
                        await store.put_checkpoint(Checkpoint(conv, position, 0, 1))
                    continue
                await store.put_checkpoint(Checkpoint(conv, position, 0, 1))
        for conv, bodies_ in expected.items():
            log = await store.read_since(conv, 0)
            assert [e.body for e in log] == bodies_
            checkpoint = await store.latest_checkpoint(conv)
            start = 0 if checkpoint is None else checkpoint.position
            tail = await store.read_since(conv, start)
            assert tail == log[start:]
            resumed = await store.resume(conv)
            assert list(resumed.events) == tail and resumed.checkpoint == checkpoint
