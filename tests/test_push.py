"""Task-conditioned push: a bounded recalled section of folded events, chosen before a call.

Off by default; on, it appears only once history is folded, names positions the
model can expand, stays within its budget, scores superseded facts zero, is
recorded in the audit row (positions and scores) and rebuilt exactly by the audit.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from store_backends import Backend

from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.compaction.push import RECALLED_HEADER, fact_keys, mmr, query_words
from torpor.llm.protocol import SystemMessage
from torpor.store.protocol import ModelCall

SMALL = dict(working_budget=300, tail_turns=2, context_window=4_000, max_output_tokens=500,
             safety_margin=100, system_prompt="be brief")
FLOOD = "the queue drained slowly while we watched the dashboards for errors " * 3


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)


def recalled(context: list[object]) -> str | None:
    last = context[-1]
    if isinstance(last, SystemMessage) and last.text.startswith(RECALLED_HEADER):
        return last.text
    return None


def test_queries_keep_exact_strings_and_uncommon_words_and_keys_are_identifier_shaped() -> None:
    assert query_words("What is the max_inflight of cobalt-ledger, please?") == [
        "max_inflight", "cobalt-ledger",
    ]
    assert query_words("Where did we put the kubeconfig for OPS-1234?") == [
        "kubeconfig", "OPS-1234",
    ]
    assert fact_keys("note: cobalt-ledger.max_inflight = 417, and OPS-9: done") == {
        "cobalt-ledger.max_inflight", "ops-9",
    }
    assert fact_keys("Summary: nothing set here") == set()  # plain words are not keys


def test_mmr_prefers_a_different_second_pick_over_a_near_duplicate() -> None:
    a = frozenset(["deploy", "key", "alpha", "value", "1"])
    dup = frozenset(["deploy", "key", "alpha", "value", "2"])
    other = frozenset(["pool", "size", "gateway"])
    assert mmr([1.0, 0.95, 0.8], [a, dup, other], 0.7) == [0, 2, 1]
    assert mmr([1.0, 0.95, 0.8], [a, dup, other], 1.0) == [0, 1, 2]  # relevance only
    assert mmr([1.0, 0.0, 0.5], [a, dup, other], 0.7) == [0, 2]  # a zero never goes in


async def test_push_is_off_by_default_and_on_it_hands_over_the_folded_needle(
    backend: Backend,
) -> None:
    off = ScriptedModel.replies("ok", loop=True)
    on = ScriptedModel.replies("ok", loop=True)
    for c, model, config in (
        ("off", off, AgentConfig(**SMALL)),  # type: ignore[arg-type]
        ("on", on, AgentConfig(push_recall=True, push_tokens=300, **SMALL)),  # type: ignore[arg-type]
    ):
        async with Runtime(url_of(backend), model=model, agent=config) as rt:
            await rt.task(c).update(goal="rotate the cobalt-ledger credentials")
            await (await rt.send(c, "cobalt-ledger.deploy_key = 7f3a9c21 for the record")).result()
            for i in range(12):
                await (await rt.send(c, f"flood {i} {FLOOD}")).result()
            assert (await rt.admin.inspect(c)).checkpoint_position is not None
            await (await rt.send(c, "What is the deploy_key of cobalt-ledger?")).result()
            calls = await rt.store.model_calls(c, limit=1_000)
            needle = 1  # position 0 is the card
            if model is off:
                assert all(recalled(ctx) is None for ctx in model.calls)
                assert all(call.pushed == () for call in calls)
                continue
            text = recalled(model.calls[-1])
            assert text is not None and f"#{needle} user: cobalt-ledger.deploy_key" in text
            last = calls[-1]
            assert last.pushed[0] == needle and 0 < last.pushed_scores[0] <= 1
            assert list(last.pushed_scores) == sorted(last.pushed_scores, reverse=True)
            for call in calls:  # every call within the section's budget
                assert call.sections.get("recalled", 0) <= 300
            assert (await rt.admin.rendered(c, -1)).matches
            # before the first fold nothing is pushed
            assert calls[0].pushed == () and recalled(model.calls[0]) is None


async def _pushed_for(notes: tuple[str, str, str], question: str) -> tuple[str, ModelCall]:
    """Three notes, a flood that folds them away, then ``question``: the recalled section
    pushed into that last call, and its audit record."""
    model = ScriptedModel.replies("ok", loop=True)
    config = AgentConfig(push_recall=True, **SMALL)  # type: ignore[arg-type]
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        for note in notes:
            await (await rt.send("c", note)).result()
        for i in range(12):
            await (await rt.send("c", f"flood {i} {FLOOD}")).result()
        await (await rt.send("c", question)).result()
        text = recalled(model.calls[-1])
        assert text is not None
        return text, (await rt.store.model_calls("c", limit=1_000))[-1]


async def test_a_superseded_fact_scores_zero_and_the_later_value_is_pushed() -> None:
    text, last = await _pushed_for(
        ("gateway-7.pool_size = 16 as agreed", "unrelated chatter about lunch plans",
         "change of plan: gateway-7.pool_size = 48"),
        "What pool_size did we settle on for gateway-7?",
    )
    assert "pool_size = 48" in text and "pool_size = 16" not in text
    assert 4 in last.pushed and 0 not in last.pushed


async def test_push_follows_an_identifier_for_the_second_hop() -> None:
    text, last = await _pushed_for(
        ("amber-vault.deploy_key: see ticket OPS-4821", "lunch was fine",
         "Ticket OPS-4821 resolved: value 9f8e7d6c"),
        "What is the deploy_key of amber-vault?",
    )
    assert "#0 user: amber-vault.deploy_key: see ticket OPS-4821" in text
    assert "#4 user: Ticket OPS-4821 resolved: value 9f8e7d6c" in text
    hop = last.pushed_scores[last.pushed.index(4)]
    assert 0 < hop <= last.pushed_scores[last.pushed.index(0)]


async def test_an_earlier_recall_quoting_a_stale_value_is_not_pushed_and_supersedes_nothing(
) -> None:
    from torpor.llm import Call, Text

    steps: list[object] = [[Text("ok")]] * 3
    steps += [[Call("recall", {"query": "gateway-7.pool_size"})], [Text("found it")]]
    model = ScriptedModel([*steps, [Text("ok")]], loop=True)  # type: ignore[list-item]
    config = AgentConfig(push_recall=True, **SMALL)  # type: ignore[arg-type]
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        await (await rt.send("c", "gateway-7.pool_size = 16 as agreed")).result()
        await (await rt.send("c", "change of plan: gateway-7.pool_size = 48")).result()
        await (await rt.send("c", "noted")).result()
        await (await rt.send("c", "which pool size again?")).result()  # recalls: quotes both
        kinds = [e.kind for e in reversed(await rt.history("c"))]
        echo = kinds.index("tool_result")
        for i in range(12):
            await (await rt.send("c", f"flood {i} {FLOOD}")).result()
        await (await rt.send("c", "What pool_size did we settle on for gateway-7?")).result()
        text = recalled(model.calls[-1])
        assert text is not None and "pool_size = 48" in text
        last = (await rt.store.model_calls("c", limit=1_000))[-1]
        assert 2 in last.pushed and echo not in last.pushed and 0 not in last.pushed


@pytest.mark.parametrize("budget", [64, 150])
async def test_the_recalled_section_never_exceeds_its_budget(budget: int) -> None:
    model = ScriptedModel.replies("ok", loop=True)
    config = AgentConfig(push_recall=True, push_tokens=budget, **SMALL)  # type: ignore[arg-type]
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        for i in range(10):
            await (await rt.send("c", f"svc-{i}.timeout_ms = {100 + i} " + "retry " * 40)).result()
        for i in range(10):
            await (await rt.send("c", f"flood {i} {FLOOD}")).result()
        await (await rt.send("c", "timeout_ms for " + " ".join(f"svc-{i}" for i in range(10)))
               ).result()
        last = (await rt.store.model_calls("c", limit=1_000))[-1]
        assert last.pushed, "something was pushed"
        assert 0 < last.sections["recalled"] <= budget
        assert (await rt.admin.rendered("c", -1)).matches


async def test_with_push_on_each_call_repeats_the_previous_calls_prefix_up_to_its_tail() -> None:
    # The recalled section goes last (compaction/sections.py): between folds, a call's
    # messages start with everything the previous call was sent except that section, so a
    # provider's prefix cache keeps the tail (placed before the tail, it would not).
    model = ScriptedModel.replies("ok", loop=True)
    config = AgentConfig(push_recall=True, **SMALL)  # type: ignore[arg-type]
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        for i in range(6):
            await (await rt.send("c", f"svc-{i}.timeout_ms = {100 + i}")).result()
        for i in range(12):
            await (await rt.send("c", f"flood {i} {FLOOD}")).result()
        for i in range(4):
            await (await rt.send("c", f"timeout_ms of svc-{i}?")).result()
        calls = await rt.store.model_calls("c", limit=1_000)
        checked = 0
        for (a, ra), (b, rb) in itertools.pairwise(zip(model.calls, calls, strict=True)):
            if ra.compaction_cycle != rb.compaction_cycle or not ra.pushed:
                continue  # a fold rewrites the handoff; without push nothing trails
            assert recalled(a) is not None and recalled(b) is not None
            stable = a[:-1]
            assert b[: len(stable)] == stable
            checked += 1
        assert checked >= 2


async def test_a_push_that_fails_leaves_the_call_without_a_section_not_a_failed_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    config = AgentConfig(push_recall=True, **SMALL)  # type: ignore[arg-type]
    async with Runtime(url, model=ScriptedModel.replies("ok", loop=True), agent=config) as rt:
        await (await rt.send("c", "cobalt-ledger.deploy_key = 7f3a9c21")).result()
        for i in range(12):
            await (await rt.send("c", f"flood {i} {FLOOD}")).result()
        assert (await rt.admin.inspect("c")).checkpoint_position is not None
    # The folded needle's row is damaged behind the store's back: searching it now raises.
    await Backend("sqlite", str(tmp_path / "log.db")).sql(
        "UPDATE events SET body = ? WHERE position = 0", b"\xc1\xff garbage"
    )
    model = ScriptedModel.replies("still here")
    async with Runtime(url, model=model, agent=config) as rt:
        final = await (await rt.send("c", "What is the deploy_key of cobalt-ledger?")).result()
        assert final.text == "still here"  # type: ignore[union-attr]
        last = (await rt.store.model_calls("c", limit=1_000))[-1]
        assert last.pushed == () and recalled(model.calls[0]) is None
    assert "push_failed" in caplog.text
