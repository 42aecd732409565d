"""Issue 19, item 3: a large append is measured off the event loop, in order.

An append with more than ``INLINE_TEXT`` characters of text is prepared (token
count, hints) on a worker thread; appends of the same conversation made
meanwhile are queued after it, in the order of the calls; other conversations'
appends commit at once. The last test is the issue's own: while a megabyte
without spaces is logged, another conversation's turn completes. The token
counter here wraps the real one and can hold a large text until the test lets
it go (a gate, never a sleep), and records the thread it ran on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import string
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from store_backends import Backend

import torpor
from torpor.compaction.markers import encode_hints
from torpor.compaction.tokens import make_token_counter
from torpor.events import AssistantMessage, Body, UserMessage
from torpor.runtime import host
from torpor.store.prepare import INLINE_TEXT
from torpor.store.protocol import ModelCall

LARGE = "x" * (INLINE_TEXT + 1)  # letters alone: one piece, the costliest to count


class GatedCounter:
    """The real counter; large texts wait for ``release`` (off the loop only) and fail if
    their text starts with ``fail``. Records the thread of every large count."""

    def __init__(self) -> None:
        self.count = make_token_counter()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[int] = []

    def __call__(self, body: Body) -> int:
        text = getattr(body, "text", "")
        if len(text) > INLINE_TEXT:
            self.threads.append(threading.get_ident())
            if text.startswith("fail"):
                raise RuntimeError("this counter refuses the text")
            self.entered.set()
            if threading.get_ident() != LOOP_THREAD[0]:  # on the loop it would hang the test
                self.release.wait()
        return self.count(body)


LOOP_THREAD = [0]


@pytest.fixture(autouse=True)
def _loop_thread() -> None:
    LOOP_THREAD[0] = threading.get_ident()


@contextlib.asynccontextmanager
async def opened(backend: Backend, counter: GatedCounter, **options: Any) -> AsyncIterator[Any]:
    """The store, with ``counter``; a count still held is let go when the block ends (a
    failed assertion must not leave the store's close waiting for it)."""
    async with backend.open(token_counter=counter, **options) as store:
        try:
            yield store
        finally:
            counter.release.set()


async def _entered(counter: GatedCounter) -> None:
    await asyncio.to_thread(counter.entered.wait)


async def test_a_large_text_is_counted_off_the_loop_and_a_small_one_on_it(
    any_backend: Backend,
) -> None:
    counter = GatedCounter()
    counter.release.set()
    async with opened(any_backend, counter, hint_extractor=encode_hints) as store:
        (event,) = await store.append_events("c", [UserMessage(LARGE)])
        assert counter.threads and LOOP_THREAD[0] not in counter.threads
        assert event.tokens == make_token_counter()(UserMessage(LARGE))
        assert event.hints == encode_hints(UserMessage(LARGE))
        # the runtime's own path for an answer: audited, large, off the loop as well
        counter.threads.clear()
        call = ModelCall("c", 1, 0, 0, b"", "h", {}, 3, 0.1)
        (answer,) = await store._append_audited("c", [AssistantMessage(LARGE)], 1, 0, call)
        assert answer.position == 1 and LOOP_THREAD[0] not in counter.threads
        assert [c.turn for c in await store.model_calls("c")] == [1]
        # a small one is measured where it is appended, on the loop, with nothing deferred
        small = await store.append_events("c", [UserMessage("ping")], turn=2)
        assert small[0].position == 2 and not store._deferred


async def test_other_conversations_commit_while_a_large_append_is_prepared_and_order_is_kept(
    any_backend: Backend,
) -> None:
    counter = GatedCounter()
    async with opened(any_backend, counter) as store:
        large = store.append("a", [UserMessage(LARGE)])  # held in the counter
        after = store.append("a", [UserMessage("after the large one")])
        await _entered(counter)
        # another conversation is not held up: its append commits while "a" waits
        assert await store.append("b", [UserMessage("ping")]) == [0]
        assert await store.head("a") is None  # nothing of "a" is written yet
        assert not asyncio.ensure_future(large).done()
        counter.release.set()
        assert await large == [0]
        assert await after == [1]  # queued behind the large one, as called
        texts = [e.body.text for e in await store.read_since("a", 0)]  # type: ignore[union-attr]
        assert texts == [LARGE, "after the large one"]


async def test_a_large_append_refused_off_the_loop_keeps_the_order_of_the_rest(
    any_backend: Backend,
) -> None:
    counter = GatedCounter()
    async with opened(any_backend, counter) as store:
        first = store.append("a", [UserMessage(LARGE)])  # held
        await _entered(counter)
        refused = store.append("a", [UserMessage("fail" + LARGE)])  # fails on its thread
        last = store.append("a", [UserMessage("last")])
        with pytest.raises(RuntimeError, match="refuses"):
            await refused
        counter.release.set()
        # "last" waited for "first" although the one between them failed before it
        assert (await first, await last) == ([0], [1])


async def test_closing_commits_a_large_append_still_being_prepared(backend: Backend) -> None:
    counter = GatedCounter()
    async with opened(backend, counter) as store:
        large = store.append("a", [UserMessage(LARGE)])  # held in the counter
        await _entered(counter)
        # Let the count finish once close() waits for it, or, were close() not to wait,
        # once it has closed: the append must be committed either way.
        settle = store._settle

        async def settle_then_wait() -> None:
            counter.release.set()
            await settle()

        store._settle = settle_then_wait  # type: ignore[method-assign]
        closing = asyncio.ensure_future(store.close())
        closing.add_done_callback(lambda _: counter.release.set())
        await closing
        assert await large == [0]
    async with backend.open() as reopened:
        assert await reopened.head("a") == 0


async def test_another_conversation_answers_while_a_megabyte_message_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = GatedCounter()  # the runtime's counter, holding the large text until let go
    monkeypatch.setattr(host, "make_token_counter", lambda encoding: counter)
    text = "".join(random.Random(19).choices(string.ascii_letters, k=1_000_000))
    model = torpor.ScriptedModel.replies("ok", loop=True)
    try:
        async with torpor.Runtime(f"sqlite:///{tmp_path / 'rt.db'}", model=model) as rt:
            await (await rt.send("other", "hello")).result()
            logging = asyncio.ensure_future(rt.send("big", text))
            await _entered(counter)  # the megabyte is being counted now
            answer = await (await rt.send("other", "ping")).result()
            assert isinstance(answer, AssistantMessage) and answer.text == "ok"
            assert not logging.done()  # the other turn did not wait for the count
            assert counter.threads and LOOP_THREAD[0] not in counter.threads
            counter.release.set()
            big = await (await logging).result()
            assert isinstance(big, AssistantMessage) and big.text == "ok"
            (logged,) = [e for e in await rt.store.read_since("big", 0) if e.kind == "user"]
            assert logged.body == UserMessage(text)
            assert logged.tokens == make_token_counter()(UserMessage(text))
    finally:
        counter.release.set()
