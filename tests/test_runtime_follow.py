"""Following a conversation: ``subscribe(after=)`` replays the log, then the text in flight,
then everything live, with no gap and no duplicate at any seam (issue 8, item 3)."""

from __future__ import annotations

import anyio

from torpor import AssistantMessage, EchoModel, Event, Runtime, TextDelta


async def test_a_replay_read_after_live_items_arrived_drops_their_text_too() -> None:
    # Found by the fuzzer: a follower of an agent that was not live replays lazily; when
    # a turn ran before its first read, the replay held the answer, and the answer's
    # live text was delivered after it, spoiling the text of the next answer.
    async with Runtime("sqlite://", model=EchoModel(chunk_size=2)) as rt:
        await (await rt.send("c", "hello")).result()
        assert await rt.admin.evict("c")
        follower = rt.subscribe("c", after=-1)  # not live: nothing to cut at yet
        await (await rt.send("c", "again")).result()  # pushed live, before any read
        items = []
        with anyio.fail_after(5):
            async for item in follower:
                items.append(item)
                if isinstance(item, Event) and item.position == 3:
                    break
            await rt.send("c", "third")
            async for item in follower:
                items.append(item)
                if isinstance(item, Event) and item.position == 5:
                    break
        follower.close()
        assert [i.position for i in items if isinstance(i, Event)] == [0, 1, 2, 3, 4, 5]
        assert all(isinstance(i, Event) for i in items[:4])  # the replay: events only
        text = "".join(i.text for i in items if isinstance(i, TextDelta))
        last = items[-1].body
        assert isinstance(last, AssistantMessage) and text == last.text == "echo: third"
