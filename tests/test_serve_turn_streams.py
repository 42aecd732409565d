"""Turn-scoped streams over real HTTP: a POST streams its own turn only, every delta says
its turn, ``GET …/stream?turn=N`` resumes one turn, offsets in UTF-16 units for JavaScript."""

from __future__ import annotations

import json
import shutil

import anyio
from serve_support import events_until, kinds, post_message, served, text_of

from torpor import Runtime, ScriptedModel
from torpor.llm.scripted import Signal, Text, Wait
from torpor.serve.client import Client, HTTPStatusError, SSEEvent


def turns_of(events: list[SSEEvent]) -> set[int]:
    return {e.json()["turn"] for e in events if e.id is not None}


async def read_all(client: Client, path: str, headers: dict[str, str] | None = None
                   ) -> tuple[int, list[SSEEvent]]:
    """A stream read to its end (the server ends a turn's stream at the turn's end)."""
    conn, response = await client.open("GET", path, conn=client.connection(),
                                       headers=headers or {})
    try:
        if response.status != 200:
            await response.read()
            return response.status, []
        return 200, [e async for e in response.events()]
    finally:
        await conn.close()


async def test_two_messages_back_to_back_each_post_streams_its_own_turn() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([
        [Text("first "), Text("answer "), Signal(reached), Wait(go), Text("goes "),
         Text("on "), Text("and "), Text("ends.")],
        [Text("second "), Text("answer.")],
    ])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        _, everything = await client.open("GET", "/v1/conversations/c/stream?after=-1",
                                          conn=(watch := client.connection()))
        conn1, first = await post_message(client, "c", "one")
        head1 = await events_until(first, lambda e: e.event == "delta")
        await reached.wait()
        # The second message while the first answer streams: its turn is postponed, its
        # stream opens at once with its own user message and waits for its turn to run.
        conn2, second = await post_message(client, "c", "two")
        opening = await events_until(second, lambda e: True)
        assert kinds(opening) == ["user"] and opening[0].json()["turn"] == 2
        go.set()
        rest1 = [e async for e in first.events()]  # each stream ends with its own turn
        rest2 = [e async for e in second.events()]
        await conn1.close()
        await conn2.close()
        whole = await events_until(everything, lambda e: e.event == "assistant"
                                   and e.json()["turn"] == 2)
        watch.abort()

    one, two = head1 + rest1, opening + rest2
    assert kinds(one)[0] == "user" and kinds(one)[-1] == "assistant"
    assert set(kinds(one)) == {"user", "delta", "assistant"}
    assert turns_of(one) == {1}  # deltas included: every event says its turn
    assert text_of(one) == "first answer goes on and ends." == one[-1].json()["body"]["text"]
    assert kinds(two)[0] == "user" and kinds(two)[-1] == "assistant"
    assert set(kinds(two)) == {"user", "delta", "assistant"}
    assert turns_of(two) == {2}
    assert text_of(two) == "second answer." == two[-1].json()["body"]["text"]
    # The conversation's stream follows both turns, each delta with its turn.
    assert [(e.event, e.json()["turn"]) for e in whole if e.event != "delta"] == [
        ("user", 1), ("user", 2), ("assistant", 1), ("assistant", 2)]
    by_turn = {t: "".join(e.json()["text"] for e in whole
                          if e.event == "delta" and e.json()["turn"] == t) for t in (1, 2)}
    assert by_turn == {1: "first answer goes on and ends.", 2: "second answer."}


async def test_turn_query_resumes_one_turn_and_204_once_the_client_has_its_end() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([
        [Text("alpha "), Signal(reached), Wait(go), Text("beta "), Text("gamma")],
        "later answer",
    ])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        conn, response = await post_message(client, "c", "go")
        seen = await events_until(response, lambda e: e.event == "delta")
        conn.abort()  # the network drops mid-answer
        await reached.wait()
        await client.send("c", "meanwhile")  # turn 2, logged while turn 1 streams
        resume = client.connection()
        _, again = await client.open("GET", "/v1/conversations/c/stream?turn=1", conn=resume,
                                     headers={"Last-Event-ID": seen[-1].id or ""})
        assert again.status == 200
        go.set()
        rest = [e async for e in again.events()]  # ends at turn 1's answer
        await resume.close()
        assert kinds(rest) == ["delta", "assistant"] and turns_of(rest) == {1}
        assert text_of(seen) + text_of(rest) == "alpha beta gamma" \
            == rest[-1].json()["body"]["text"]
        # The query twin of Last-Event-ID, and the client already holding the end: 204
        # (an EventSource reconnecting after the end stops there).
        status, _ = await read_all(client, f"/v1/conversations/c/stream?turn=1&after={rest[-1].id}")
        assert status == 204
        # Without a cursor: the whole turn, from its user message to its end.
        status, turn2 = await read_all(client, "/v1/conversations/c/stream?turn=2")
        assert status == 200 and turns_of(turn2) == {2}
        assert kinds(turn2)[0] == "user" and kinds(turn2)[-1] == "assistant"
        assert turn2[-1].json()["body"]["text"] == "later answer"
        status, turn1 = await read_all(client, "/v1/conversations/c/stream?turn=1")
        assert [e.event for e in turn1] == ["user", "assistant"] and turns_of(turn1) == {1}
        for bad, error in (("turn=3", "UnknownTurn"), ("turn=x", "InvalidInput")):
            try:
                await client.call("GET", f"/v1/conversations/c/stream?{bad}")
            except HTTPStatusError as exc:
                assert exc.problem is not None and exc.problem["error"] == error
            else:
                raise AssertionError(f"{bad} was served")


# Astral characters (emoji, a ZWJ family cut between deltas, a flag cut between its two
# regional indicators), combining marks, and text past the BMP only in places.
PIECES = ["Hi 👋 ", "fam 👨‍👩", "‍👧‍👦, flag 🇫", "🇷 ", "café e\u0301 n\u0303 ",
          "🧑🏽‍💻 ", "𝄞 clef ", "done ✅"]


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


async def test_resume_at_every_delta_boundary_rebuilds_astral_text_exactly() -> None:
    """Each piece is its own delta (the model waits after each); a resume from every id,
    while the answer is in flight and after it was logged, rebuilds it exactly."""
    gates = [(anyio.Event(), anyio.Event()) for _ in PIECES]
    model = ScriptedModel([[a for p, (reached, go) in zip(PIECES, gates, strict=True)
                            for a in (Text(p), Signal(reached), Wait(go))]])
    final = "".join(PIECES)
    offsets: list[tuple[str, int]] = []  # (text before a delta, its offset16), for Node
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        conn, response = await post_message(client, "c", "emoji please")
        full: list[SSEEvent] = []
        live = []
        for index, (reached, go) in enumerate(gates):
            await reached.wait()
            async for event in response.events():
                full.append(event)
                if text_of(full) == "".join(PIECES[:index + 1]):
                    break
            # In flight, at this delta boundary (the user event's id before the first).
            for event in full[len(live):]:
                live.append(await client.open(
                    "GET", "/v1/conversations/c/stream?turn=1", conn=client.connection(),
                    headers={"Last-Event-ID": event.id or ""}))
            go.set()
        full += [e async for e in response.events()]
        await conn.close()
        assert kinds(full) == ["user", *["delta"] * len(PIECES), "assistant"]
        assert text_of(full) == final == full[-1].json()["body"]["text"]
        offsets += check_offsets("", full)
        for index, (c, r) in enumerate(live):
            assert r.status == 200
            rest = [e async for e in r.events()]
            await c.close()
            held = text_of(full[:index + 1])
            assert held + text_of(rest) == final, index
            assert turns_of(rest) == {1} and kinds(rest)[-1] == "assistant"
            offsets += check_offsets(held, rest)
        # After the answer was logged: a resume from every id of the stream.
        for index, event in enumerate(full):
            status, rest = await read_all(client, "/v1/conversations/c/stream?turn=1",
                                          {"Last-Event-ID": event.id or ""})
            if index == len(full) - 1:
                assert status == 204
                continue
            held = text_of(full[:index + 1])
            assert rest[-1].event == "assistant" and rest[-1].json()["body"]["text"] == final
            if held == final:  # all the text held: the logged answer ends it
                assert kinds(rest) == ["assistant"], index
            elif held:  # the rest of the text first, as one delta
                assert kinds(rest) == ["delta", "assistant"], index
                assert held + text_of(rest) == final, index
                offsets += check_offsets(held, rest)
            else:  # nothing of it held: the logged answer holds it all
                assert kinds(rest) == ["assistant"], index
    assert any(utf16(text) != len(text) for text, _ in offsets)  # astral text was counted
    node = shutil.which("node")
    if node is not None:  # JavaScript's own String.length agrees with every offset16
        script = ("const d=JSON.parse(require('fs').readFileSync(0,'utf8'));"
                  "console.log(JSON.stringify(d.filter(([t,o])=>t.length!==o)));")
        with anyio.fail_after(60):
            out = await anyio.run_process([node, "-e", script],
                                          input=json.dumps(offsets).encode())
        assert json.loads(out.stdout) == []


def check_offsets(before: str, events: list[SSEEvent]) -> list[tuple[str, int]]:
    """Each delta's ``offset`` counts code points and ``offset16`` UTF-16 units of the
    message's text before it (what JavaScript's ``String.length`` counts)."""
    text, seen = before, []
    for event in events:
        if event.event != "delta":
            continue
        data = event.json()
        assert data["offset"] == len(text) and data["offset16"] == utf16(text), text
        seen.append((text, data["offset16"]))
        text += data["text"]
    return seen
