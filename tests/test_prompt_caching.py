"""Prompt caching from the append-only prefix, checked on the bytes the SDKs send.

A 30-turn conversation (some turns call two tools) folds twice. Between folds,
every request's body must start with the exact bytes of the previous request's
body up to the end of its last message: that is what automatic prefix caching
(OpenAI, vLLM, llama.cpp) matches, and what Anthropic's cache reads. For
Anthropic, whose breakpoints move on by design, the same holds once the
``cache_control`` markers are set aside, and the markers must sit on the system
prompt, the fold's handoff, the end of the stable history (the message before
the newest user message) and the final message: four at most.

Retention stubbing (``keep_tool_results``) rewrites an older tool result into a
stub when a newer one arrives, which changes the prefix from that result on; a
conversation that wants every byte cached between folds keeps results until the
fold (a ``keep_tool_results`` above what a fold's span holds), as here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import pytest
from providers import ANTHROPIC, OPENAI, PROVIDERS, Provider
from replay import Recorded, ReplayServer, Reply

import torpor
from torpor import AgentConfig, Runtime
from torpor.llm.openai_chat import cache_key

TURNS = 30
MARK = b',"cache_control":{"type":"ephemeral"}'


@torpor.tool
async def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny and 21 degrees in {city}"


def respond(provider: Provider) -> Any:
    """Answer like a model would: tool calls when asked about weather, then text."""
    count = 0

    def reply(request: Recorded) -> Reply:
        nonlocal count
        count += 1
        last = provider.messages(request)[-1]
        text = last["content"] if provider is OPENAI else last["content"][-1].get("text", "")
        if last["role"] == "user" and isinstance(text, str) and "weather" in text:
            n = count
            return provider.calls([(f"call_{n}a", "lookup", ['{"city": "Os', 'lo"}']),
                                   (f"call_{n}b", "lookup", ['{"city":', ' "Lima"}'])])
        return provider.text([f"Answer {count}: ", "noted, " * 6, "and that is all."])

    return reply


@pytest.fixture(params=PROVIDERS, ids=lambda p: p.name)
def provider(request: pytest.FixtureRequest) -> Provider:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def server(provider: Provider) -> AsyncIterator[ReplayServer]:
    async with ReplayServer(default=respond(provider)) as running:
        yield running


def messages_end(body: bytes) -> int:
    """Offset of the ``]`` closing the body's ``messages`` array (strings skipped)."""
    start = body.index(b'"messages":[') + len(b'"messages":[')
    depth, i, in_string = 1, start, False
    while True:
        c = body[i]
        if in_string:
            if c == 0x5C:  # backslash: skip the escaped byte
                i += 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):
            depth += 1
        elif c in (0x5D, 0x7D):
            depth -= 1
            if depth == 0:
                return i
        i += 1


def breakpoints(body: dict[str, Any]) -> list[str]:
    """Where the cache_control markers of an Anthropic request sit, by name."""
    found = [f"system[{i}]" for i, b in enumerate(body.get("system", ())) if "cache_control" in b]
    for m, message in enumerate(body["messages"]):
        for b, block in enumerate(message["content"]):
            if "cache_control" in block:
                found.append(f"messages[{m}][{b}]")
    return found


def expected_breakpoints(body: dict[str, Any]) -> list[str]:
    messages = body["messages"]
    newest_user = max(i for i, m in enumerate(messages) if m["role"] == "user"
                      and any(b["type"] == "text" for b in m["content"]))
    where = [f"system[{i}]" for i in range(len(body.get("system", ())))]
    if newest_user > 0:
        stable_end = messages[newest_user - 1]
        where.append(f"messages[{newest_user - 1}][{len(stable_end['content']) - 1}]")
    where.append(f"messages[{len(messages) - 1}][{len(messages[-1]['content']) - 1}]")
    return where


async def test_between_folds_each_request_extends_the_previous_one(
    provider: Provider, server: ReplayServer
) -> None:
    agent = AgentConfig(model=provider.model(server), system_prompt="You are terse.",
                        tools=[lookup], recall_tools=False, working_budget=900,
                        tail_turns=2, keep_tool_results=100)
    async with Runtime("sqlite://", agent=agent) as rt:
        for i in range(TURNS):
            ask = (f"turn {i}: what is the weather in Oslo and Lima?" if i % 5 == 3
                   else f"turn {i}: please note item-{i:03d} " + "and more " * 8)
            await (await rt.send("c", ask)).result()
        checkpoints = await rt.store.checkpoints("c")
        calls = await rt.store.model_calls("c", limit=1_000)
    assert len(checkpoints) == 2
    requests = server.requests
    assert len(requests) == len(calls) == TURNS + TURNS // 5
    extended = folds = 0
    for (before, after), (c0, c1) in zip(pairwise(requests), pairwise(calls), strict=True):
        if c1.compaction_cycle != c0.compaction_cycle:
            folds += 1  # a fold rewrites the prefix on purpose: the one allowed break
            continue
        old, new = before.body, after.body
        if provider is ANTHROPIC:  # breakpoints move on by design; the content must not
            old, new = old.replace(MARK, b""), new.replace(MARK, b"")
        end = messages_end(old)
        assert new[:end] == old[:end], f"request {requests.index(after)} rewrote the prefix"
        assert new[end:end + 1] == b","  # and only appended messages after it
        extended += 1
    assert folds == 2 and extended == len(requests) - 3
    if provider is ANTHROPIC:
        for request in requests:
            body = request.json()
            assert breakpoints(body) == expected_breakpoints(body)
            assert len(breakpoints(body)) <= 4
        # After a fold, the system prompt block is still the first, unchanged, breakpoint.
        firsts = {json.dumps(r.json()["system"][0]) for r in requests}
        assert len(firsts) == 1
        assert len(requests[-1].json()["system"]) == 2  # the handoff, with its own breakpoint
    else:
        systems = [r.json()["messages"][0]["content"] for r in requests]
        assert all(s.startswith("You are terse.") for s in systems)


async def test_openai_sends_one_stable_cache_key_per_conversation() -> None:
    async with ReplayServer(default=respond(OPENAI)) as server:
        agent = AgentConfig(model=OPENAI.model(server, cache_key=True), recall_tools=False,
                            working_budget=150, tail_turns=1)
        async with Runtime("sqlite://", agent=agent) as rt:
            for i in range(6):
                for conversation in ("alice", "bob"):
                    await (await rt.send(conversation, f"hello {i} " + "word " * 20)).result()
            assert await rt.store.checkpoints("alice")  # the key survives folds
    keys: dict[str, set[str]] = {}
    for n, request in enumerate(server.requests):  # turns alternate: alice, bob, alice, …
        keys.setdefault(("alice", "bob")[n % 2], set()).add(request.json()["prompt_cache_key"])
    assert keys == {"alice": {cache_key("alice")}, "bob": {cache_key("bob")}}
    assert "alice" not in cache_key("alice")  # the id itself is not sent
