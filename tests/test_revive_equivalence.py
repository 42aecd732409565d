"""Revive after eviction equals the state before it: the model sees byte-identical contexts."""

from __future__ import annotations

import itertools
import re

import anyio
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torpor
from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.llm import Call, Text

Action = tuple[str, int]  # ("say" | "tool", size) ; ("evict", 0)

actions = st.lists(
    st.one_of(
        st.tuples(st.just("say"), st.integers(1, 60)),
        st.tuples(st.just("tool"), st.integers(1, 400)),
        st.tuples(st.just("evict"), st.just(0)),
        st.tuples(st.just("hibernate"), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@torpor.tool
async def lookup(size: int) -> str:
    """Returns a result of roughly ``size`` words."""
    return " ".join(f"row{i}:{i * 7919 % 1000}" for i in range(size))


def script(plan: list[Action]) -> ScriptedModel:
    steps: list[list[object]] = []
    for n, (kind, size) in enumerate(plan):
        if kind == "say":
            steps.append([Text(f"reply {n} " + "word " * size)])
        elif kind == "tool":
            steps.append([Text("looking"), Call("lookup", {"size": size}, id=f"call{n}")])
            steps.append([Text(f"found {n}")])
    return ScriptedModel(steps)  # type: ignore[arg-type]


CONFIG = AgentConfig(tools=[lookup], working_budget=600, tail_turns=2, keep_tool_results=1,
                     clear_at_least=300,  # tool results stubbed in batches
                     context_window=8_000, max_output_tokens=500, safety_margin=100)


async def run(
    plan: list[Action], *, evicting: bool, config: AgentConfig = CONFIG
) -> tuple[list[object], list[str]]:
    model = script(plan)
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        for n, (kind, size) in enumerate(plan):
            if kind in ("evict", "hibernate"):
                if evicting:
                    await anyio.wait_all_tasks_blocked()
                    agent = rt._registry.get("c")
                    already = agent is None or (kind == "hibernate" and agent.ws is None)
                    act = rt.admin.evict if kind == "evict" else rt.admin.hibernate
                    done = await act("c")
                    assert done or already  # the eviction really happened
                    await anyio.wait_all_tasks_blocked()
                    assert rt._registry.get("c") is None or rt._registry.get("c").ws is None
                continue
            text = f"user {n} " + "talk " * (size // 3)
            await (await rt.send("c", text)).result()
        audits = await rt.store.model_calls("c")
        for call in audits:  # every recorded context rebuilds from the log to the same hash
            assert (await rt.admin.rendered("c", call)).matches
        return [_normalised(context) for context in model.calls], [a.call_index for a in audits]


_CLOCK = re.compile(r"\d{4}-\d\d-\d\d[ T]?[\d:]*|\d\d:\d\d(:\d\d)?")


def _normalised(context: object) -> bytes:
    """Wall-clock times in markers differ between two runs by construction; nothing else may."""
    return _CLOCK.sub("<time>", msgspec.json.encode(context).decode()).encode()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions)
def test_contexts_after_evict_and_revive_equal_those_of_an_agent_never_evicted(
    plan: list[Action],
) -> None:
    async def both() -> None:
        kept_calls, kept_index = await run(plan, evicting=False)
        evicted_calls, evicted_index = await run(plan, evicting=True)
        assert evicted_calls == kept_calls
        assert evicted_index == kept_index

    anyio.run(both)


BATCHES = AgentConfig(tools=[lookup], working_budget=20_000, keep_tool_results=1,
                      clear_at_least=900, context_window=32_000, max_output_tokens=500)


def test_batched_clearing_is_decided_the_same_after_evict_and_revive() -> None:
    """No fold here: only batched stub clears change the prefix, and an agent revived
    between them decides each clear exactly where one never evicted does."""
    plan: list[Action] = []
    for n in range(12):
        plan.append(("tool", 60))  # a result of ~300 tokens: three make a batch
        if n % 3 == 1:
            plan.append(("evict" if n % 2 else "hibernate", 0))

    async def both() -> None:
        kept, kept_index = await run(plan, evicting=False, config=BATCHES)
        evicted, evicted_index = await run(plan, evicting=True, config=BATCHES)
        assert evicted == kept and evicted_index == kept_index
        stubs = [context.count(b"elided") for context in kept]
        assert max(stubs) >= 6  # several batches were cleared ...
        changes = sum(b > a for a, b in itertools.pairwise(stubs))
        assert changes < max(stubs) // 2  # ... more than one result at a time

    anyio.run(both)


_SUBJECTS = ("scheduler", "autoscaler", "ingress", "volumes", "logging", "metrics", "quotas")


def _kubernetes_chat(n: int) -> str:
    """Every message mentions kubernetes (the background); turns 24-29 are about certificates."""
    if 24 <= n < 30:
        return f"user {n}: the kubernetes certificates expired, renew the certificates now"
    return f"user {n}: the kubernetes {_SUBJECTS[n % len(_SUBJECTS)]} " + "please " * 20


async def _checkpoints(evicting: bool) -> tuple[list[bytes], list[torpor.Checkpoint]]:
    model = ScriptedModel([[Text(f"noted {n}")] for n in range(48)])
    async with Runtime("sqlite://", model=model, agent=CONFIG) as rt:
        for n in range(48):
            await (await rt.send("c", _kubernetes_chat(n))).result()
            if evicting and n % 5 == 2:
                await anyio.wait_all_tasks_blocked()
                assert await (rt.admin.evict if n % 2 else rt.admin.hibernate)("c")
        return [_normalised(c) for c in model.calls], await rt.store.checkpoints("c")


def test_markers_name_what_a_span_is_about_against_the_background_after_revival_too() -> None:
    """Markers score prose against the conversation's background, which each checkpoint
    carries: a revived agent folds to the same markers (and contexts) as a live one."""

    async def both() -> None:
        kept_calls, kept = await _checkpoints(evicting=False)
        evicted_calls, evicted = await _checkpoints(evicting=True)
        assert evicted_calls == kept_calls
        assert [c.background for c in evicted] == [c.background for c in kept]
        assert [[m.topics for m in c.markers] for c in evicted] == [
            [m.topics for m in c.markers] for c in kept
        ]
        assert len(kept) >= 3
        background = kept[-1].background
        assert background is not None and background.words[0] == "kubernetes"
        assert background.events == kept[-1].position  # every folded event, none twice
        # Each fold scored against a known background (after the first): its own marker
        # (the newest, while still of level 0) never names the conversation's word, and
        # the fold over the certificate turns (events 48-59) names them.
        own = [
            checkpoint.markers[-1]
            for previous, checkpoint in itertools.pairwise(kept)
            if checkpoint.markers[-1].level == 0
        ]
        assert own and all("kubernetes" not in m.topics for m in own)
        assert any("certificates" in m.topics for m in own if m.start <= 59)
        first = kept[0].markers[0].topics  # no background yet: common English alone
        assert "kubernetes" in first and "certificates" not in first

    anyio.run(both)

