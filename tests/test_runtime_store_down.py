"""The runtime when the store cannot write: callers get StoreUnavailable, the agent is not
counted as crashing, and it serves again by itself once writes succeed (issue 8, item 6)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from support import writes_fail, writes_succeed

from torpor import (
    Aborted,
    Event,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    StoreUnavailable,
    TextDelta,
    UserMessage,
)
from torpor.llm import Signal, Text, Wait

CONFIG = RuntimeConfig(backoff_initial=0.01, backoff_max=0.05)


async def test_a_stream_whose_answer_cannot_be_logged_is_aborted_with_the_text_it_streamed(
    tmp_path: Path,
) -> None:
    # Found by the fuzzer: followers had the streamed text, the log's Aborted had none.
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("half an "), Text("answer"), Signal(reached), Wait(go)],
                           [Text("back")]])
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, config=CONFIG) as rt:
        follower = rt.subscribe("c", after=-1)
        turn = await rt.send("c", "question")
        await reached.wait()
        await writes_fail(rt.store)
        go.set()  # the answer is complete, and its append fails
        with anyio.fail_after(5):
            try:
                await turn.result()
            except StoreUnavailable:
                pass
            else:
                raise AssertionError("the answer was logged on a store that cannot write")
        late = rt.subscribe("c")  # joins after the stream died, before the abort is logged
        await writes_succeed(rt.store)
        items = []
        with anyio.fail_after(5):
            async for item in follower:
                items.append(item)
                if isinstance(item, Event) and isinstance(item.body, Aborted):
                    break
            late_items = []
            async for item in late:
                late_items.append(item)
                if isinstance(item, Event) and isinstance(item.body, Aborted):
                    break
        streamed = "".join(i.text for i in items if isinstance(i, TextDelta))
        aborted = items[-1].body
        assert isinstance(aborted, Aborted) and aborted.reason == "interrupted"
        assert streamed == "half an answer" == aborted.partial_text
        # a follower that joined after the stream died gets the text in flight first
        assert "".join(i.text for i in late_items if isinstance(i, TextDelta)) == streamed
        assert (await (await rt.send("c", "again")).result()).text == "back"
        assert (await rt.admin.stats()).crashes == 0
        users = [e.body.text for e in await rt.store.read_since("c", 0)
                 if isinstance(e.body, UserMessage)]
        assert users == ["question", "again"]
        follower.close()
        late.close()


async def test_a_cancel_whose_abort_cannot_be_logged_says_so(tmp_path: Path) -> None:
    # Found by the fuzzer: cancel returned True, yet the log never ended the turn with a
    # cancelled abort (it could not write one); the turn ended "interrupted" later.
    reached, never = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("slow"), Signal(reached), Wait(never)], [Text("back")]])
    async with Runtime(f"sqlite:///{tmp_path}/c.db", model=model, config=CONFIG) as rt:
        turn = await rt.send("c", "question")
        await reached.wait()
        await writes_fail(rt.store)
        with anyio.fail_after(5), pytest.raises(StoreUnavailable):
            await rt.cancel("c")
        with pytest.raises(StoreUnavailable):
            await turn.result()
        await writes_succeed(rt.store)
        with anyio.fail_after(5):
            assert (await (await rt.send("c", "again")).result()).text == "back"
        bodies = [e.body for e in await rt.store.read_since("c", 0)]
        aborted = [b for b in bodies if isinstance(b, Aborted)]
        assert [(a.reason, a.partial_text) for a in aborted] == [("interrupted", "slow")]
        assert (await rt.admin.stats()).crashes == 0
