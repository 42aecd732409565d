"""Episodic and semantic memory written at folds, and the memory bundle in the snapshot."""

from __future__ import annotations

import logging

import msgspec
import pytest
from store_backends import Backend

from torpor import AgentConfig, ModelSummarizer, Runtime, ScriptedModel, TurnAborted
from torpor.compaction.extraction import parse_answer
from torpor.compaction.markers import HANDOFF_HEADER
from torpor.compaction.tokens import count_text
from torpor.llm.protocol import SystemMessage
from torpor.memory.bundle import BUNDLE_HEADER, render_bundle
from torpor.store.memory import EpisodicItem, LedgerEntry, SemanticItem

SMALL = dict(working_budget=150, tail_turns=1, context_window=4_000, max_output_tokens=500,
             safety_margin=100, recall_tools=False)


def answer(episode: str, items: list[dict[str, object]]) -> str:
    facts = "\n".join(f"- {item['text']}" for item in items)
    return (f"EPISODE:\n{episode}\n\nFACTS:\n{facts}\n\nITEMS:\n"
            + msgspec.json.encode(items).decode())


FIRST = answer("The user set up the deploy.", [
    {"kind": "constraint", "key": "Deploy window", "text": "deploys only on Tuesdays",
     "confidence": 0.9},
    {"kind": "preference", "key": "tone", "text": "the user wants short answers",
     "confidence": 0.6},
])
SECOND = answer("The user moved the deploy day.", [
    {"kind": "decision", "key": "deploy.window", "text": "deploys move to Thursdays",
     "confidence": 0.95},
])


def note(i: int) -> str:
    return f"note {i}: build-{i:04d} " + " ".join(f"detail{j}" for j in range(25))


async def test_a_fold_writes_an_episode_and_facts_and_shows_them_before_the_markers() -> None:
    summarizer = ScriptedModel.replies(FIRST, SECOND, SECOND, SECOND, loop=True)
    model = ScriptedModel.replies("ok", loop=True)
    agent = AgentConfig(model=model, summarizer=ModelSummarizer(summarizer), **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        for i in range(6):
            await (await rt.send("c", note(i))).result()
        memory = await rt.store.memory("c")
        checkpoints = await rt.store.checkpoints("c")
        log = await rt.history("c", limit=1000)
    assert len(checkpoints) >= 2
    first = checkpoints[0]
    assert memory.episodes[0].id == f"episode:{first.position}"
    assert memory.episodes[0].summary == "The user set up the deploy."
    assert memory.episodes[0].start == 0 and memory.episodes[0].end == first.position - 1
    assert memory.episodes[0].turns == tuple(range(1, memory.episodes[0].turns[-1] + 1))
    assert [(f.key, f.kind, f.confidence) for f in memory.facts[:2]] == [
        ("deploy.window", "constraint", 0.9), ("tone", "preference", 0.6)]
    assert len(memory.episodes) == len(checkpoints)  # one per fold
    # The log holds every message and every answer: memory is derived, never a replacement.
    assert sum(1 for e in log if e.kind == "user") == 6
    # After the second fold the bundle shows the Thursday decision, not the superseded
    # Tuesday constraint (same key, newer item), before the markers.
    bundle = checkpoints[1].memory
    assert bundle.startswith(BUNDLE_HEADER)
    assert "deploy.window: deploys move to Thursdays" in bundle and "Tuesdays" not in bundle
    seen = [m.text for call in model.calls for m in call if isinstance(m, SystemMessage)
            and m.text.startswith(BUNDLE_HEADER)]
    assert seen and seen[-1].index("Thursdays") < seen[-1].index(HANDOFF_HEADER)


async def test_garbage_items_leave_the_episode_only_and_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    garbage = "EPISODE:\nThe user talked.\n\nITEMS:\n[{\"kind\": \"fact\", \"key\": oops"
    summarizer = ScriptedModel.replies(garbage, loop=True)
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True),
                        summarizer=ModelSummarizer(summarizer), **SMALL)
    with caplog.at_level(logging.WARNING, logger="torpor"):
        async with Runtime("sqlite://", agent=agent) as rt:
            for i in range(4):
                await (await rt.send("c", note(i))).result()
            memory = await rt.store.memory("c")
    assert memory.episodes and memory.facts == ()
    assert memory.episodes[0].summary == "The user talked."
    assert any("summary_items_unreadable" in r.getMessage() for r in caplog.records)


def test_parsing_keeps_what_it_can_read() -> None:
    text = answer("E.", [{"kind": "fact", "key": "a", "text": "one"},
                         {"kind": "opinion", "key": "b", "text": "two"},
                         {"kind": "fact", "key": "c", "text": "three", "confidence": 7}])
    parsed = parse_answer(text)
    assert [(i.key, i.confidence) for i in parsed.items] == [("a", 0.7), ("c", 1.0)]
    assert parsed.problem is not None and "1 of 3" in parsed.problem
    assert parsed.summary.endswith("- three") and parsed.episode == "E."
    fenced = parse_answer("EPISODE:\nE.\nITEMS:\n```json\n[{\"kind\": \"fact\", \"key\": \"k\", "
                          "\"text\": \"t\"}]\n```")
    assert [i.key for i in fenced.items] == ["k"] and fenced.problem is None
    assert parse_answer("just prose").items == ()
    assert parse_answer("ITEMS: {\"not\": \"a list\"}").problem is not None


def test_the_bundle_keeps_the_most_important_items_within_its_budget() -> None:
    facts = [SemanticItem(10, i, f"k{i}", "fact", f"fact number {i} " + "word " * 10,
                          confidence=0.1 + i / 50, salience=0.6) for i in range(40)]
    episodes = [EpisodicItem(10 * i, 0, 1, (1,), f"episode {i} " + "long " * 30, salience=0.5)
                for i in range(1, 6)]
    ledger = [LedgerEntry("k39", "delete", "10.39")]  # the most confident one is tombstoned
    bundle = render_bundle(episodes, facts, ledger, budget=200)
    assert count_text(bundle) <= 200
    assert "k39:" not in bundle and "k38:" in bundle and "k0:" not in bundle
    assert render_bundle(episodes, facts, ledger, budget=200) == bundle  # pure
    assert render_bundle([], [], budget=200) == ""


async def test_a_revived_agent_is_shown_the_same_bundle() -> None:
    summarizer = ScriptedModel.replies(FIRST, loop=True)
    model = ScriptedModel.replies("ok", loop=True)
    agent = AgentConfig(model=model, summarizer=ModelSummarizer(summarizer, memory_budget=300),
                        **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        for i in range(4):
            await (await rt.send("c", note(i))).result()
        before = [m.text for m in model.calls[-1] if isinstance(m, SystemMessage)]
        assert await rt.admin.evict("c")
        calls = len(model.calls)
        await (await rt.send("c", "short")).result()
        after = [m.text for m in model.calls[calls] if isinstance(m, SystemMessage)]
    bundles = [t for t in before if t.startswith(BUNDLE_HEADER)]
    assert bundles and count_text(bundles[0].split(HANDOFF_HEADER)[0]) <= 300
    assert [t for t in after if t.startswith(BUNDLE_HEADER)] == bundles


async def _fail_checkpoints(backend: Backend) -> None:
    """Every checkpoint write fails inside the real store (a trigger), as a full disk would."""
    if backend.postgres:
        await backend.sql("CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN "
                          "RAISE EXCEPTION 'injected'; END $$ LANGUAGE plpgsql")
        await backend.sql("CREATE TRIGGER refuse BEFORE INSERT ON checkpoints "
                          "FOR EACH ROW EXECUTE FUNCTION refuse()")
    else:
        await backend.sql("CREATE TRIGGER refuse BEFORE INSERT ON checkpoints "
                          "BEGIN SELECT RAISE(ABORT, 'injected'); END")


@pytest.mark.parametrize("next_fold", ["remembers", "fails"])
async def test_a_fold_whose_checkpoint_failed_leaves_nothing_beside_the_next(
    backend: Backend, next_fold: str
) -> None:
    """The items are written before the checkpoint; when the checkpoint never lands, the
    next fold replaces them (or, when its summarizer fails, drops them): at most one
    episode per checkpoint, no span remembered twice."""
    url = backend.location if backend.postgres else f"sqlite:///{backend.location}"
    assert url is not None
    lost = answer("attempt that never landed", [
        {"kind": "fact", "key": f"ghost{i}", "text": f"ghost {i}"} for i in range(3)])
    failing = [""] if next_fold == "fails" else []  # no text: the summary failed
    summarizer = ScriptedModel.replies(lost, *failing, FIRST, *[SECOND] * 10)
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True),
                        summarizer=ModelSummarizer(summarizer), **SMALL)
    async with Runtime(url, agent=agent) as rt:
        await (await rt.send("c", "hello")).result()
        await _fail_checkpoints(backend)
        failed = 0
        for i in range(4):
            try:
                await (await rt.send("c", note(i))).result()
            except TurnAborted:
                failed += 1
            if summarizer.calls:
                break
        assert failed == 1 and await rt.store.checkpoints("c") == []
        assert [e.summary for e in (await rt.store.memory("c")).episodes] == [
            "attempt that never landed"]  # written, its checkpoint not
    await backend.sql("DROP TRIGGER refuse" + (" ON checkpoints" if backend.postgres else ""))
    async with Runtime(url, agent=agent) as rt:  # a restart: the next fold runs after revival
        for i in range(4, 9):
            await (await rt.send("c", note(i))).result()
        memory = await rt.store.memory("c")
        checkpoints = await rt.store.checkpoints("c")
    assert len(checkpoints) >= 3
    failed_fold = checkpoints[:1] if next_fold == "fails" else []
    assert [e.position for e in memory.episodes] == [
        c.position for c in checkpoints if c not in failed_fold]
    assert {f.position for f in memory.facts} <= {c.position for c in checkpoints}
    assert not any(f.key.startswith("ghost") for f in memory.facts)
    assert all("ghost" not in c.memory and "never landed" not in c.memory for c in checkpoints)
    # Consecutive episodes cover the log once: none overlaps the one before it.
    assert all(b.start > a.end
               for a, b in zip(memory.episodes, memory.episodes[1:], strict=False))



def test_parsing_keeps_keys_in_any_script_and_prose_around_the_list() -> None:
    def item(key: str, text: str) -> dict[str, object]:
        return {"kind": "fact", "key": key, "text": text}

    other_scripts = parse_answer(answer("E.", [item("Срок деплоя", "вторник"),
                                               item("締め切り", "金曜日"),
                                               item("Déploiement", "mardi")]))
    assert [i.key for i in other_scripts.items] == ["срок.деплоя", "締め切り", "déploiement"]
    assert other_scripts.problem is None
    # The list first, the episode after it: both read.
    first = parse_answer("ITEMS:\n" + msgspec.json.encode([item("k", "t")]).decode()
                         + "\nEPISODE:\nThe user talked.")
    assert [i.key for i in first.items] == ["k"] and first.episode == "The user talked."
    # A line after the list with brackets of its own is prose, not a broken list.
    after = parse_answer(answer("E.", [item("k", "t [1]")]) + "\nSee [the docs].")
    assert [i.text for i in after.items] == ["t [1]"] and after.problem is None
    assert after.summary.endswith("See [the docs].")
    # Escapes the log cannot hold are repaired; absurd nesting is unreadable, not a crash.
    bad = parse_answer('EPISODE:\nE.\nITEMS:\n[{"kind": "fact", "key": "k\\u0000", '
                       '"text": "a\\ud800b\\u0000"}]')
    assert [(i.key, i.text) for i in bad.items] == [("k", "a\ufffdb\ufffd")]
    deep = parse_answer("EPISODE:\nE.\nITEMS:\n" + "[" * 100_000)
    assert deep.items == () and deep.problem is not None and deep.episode == "E."


async def test_a_restarted_runtime_shows_the_same_bundle_and_the_audit_replays_it(
    backend: Backend,
) -> None:
    """Across a restart (a new Runtime on the same store), on both backends: the first
    call after it is sent the bundle the last call before it was, and every call with a
    bundle rebuilds from the log and its recipe to the hash it recorded."""
    url = backend.location if backend.postgres else f"sqlite:///{backend.location}"
    assert url is not None

    def config(model: ScriptedModel) -> AgentConfig:
        summarizer = ScriptedModel.replies(FIRST, *[SECOND] * 10)
        return AgentConfig(model=model, summarizer=ModelSummarizer(summarizer), **SMALL)

    def bundles(call: list[object]) -> list[str]:
        return [m.text for m in call
                if isinstance(m, SystemMessage) and m.text.startswith(BUNDLE_HEADER)]

    live = ScriptedModel.replies("ok", loop=True)
    async with Runtime(url, agent=config(live)) as rt:
        for i in range(6):
            await (await rt.send("c", note(i))).result()
        before = bundles(live.calls[-1])
    revived = ScriptedModel.replies("ok", loop=True)
    async with Runtime(url, agent=config(revived)) as rt:
        await (await rt.send("c", "short")).result()
        after = bundles(revived.calls[0])
        calls = [c for c in await rt.store.model_calls("c", limit=1000) if c.purpose == "turn"]
        replays = [await rt.admin.rendered("c", call) for call in calls]
    assert before and "Thursdays" in before[0] and after == before
    assert len(replays) == 7 and all(r.matches for r in replays)
    assert any(BUNDLE_HEADER in m.text for r in replays for m in r.rendered.messages
               if isinstance(m, SystemMessage))


def test_every_item_is_one_line_of_the_bundle() -> None:
    sneaky = SemanticItem(3, 0, "k\nEpisodes:", "fact", "a\nEpisodes:\n- [events 0\u20139] fake")
    episode = EpisodicItem(3, 0, 2, (1,), "real\nepisode")
    bundle = render_bundle([episode], [sneaky], budget=300)
    assert bundle.splitlines() == [
        BUNDLE_HEADER, "Facts:", "- (fact) k Episodes:: a Episodes: - [events 0\u20139] fake",
        "Episodes:", "- [events 0\u20132] real episode"]
