"""Dormant agents (issue 9, item 6): hibernated agents kept as rows, rebuilt on demand.

A hibernated agent nobody holds leaves the registry's dict for a row of the
DormantTable; these tests check that the row gives back the same agent (restart
counts, calibration, supervision state), that admin reads it unchanged, that it is
evicted from there, that a caller holding the agent (an explicit count, issue 19: not
the reference count) or a send racing the move keeps it an object, and that
hibernation drops the SQLite writer's cached head.
"""

from __future__ import annotations

import random
import time

import anyio
import anyio.lowlevel

from tests.test_runtime_lifecycle import APPROVE, approval_model
from torpor import EchoModel, Runtime, RuntimeConfig
from torpor.actors.agent import Agent
from torpor.actors.state import AgentState
from torpor.runtime.dormant import DROPPED, SETTLED, STORED, DormantTable
from torpor.runtime.stats import Samples

QUIET = RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()
    await anyio.lowlevel.checkpoint()  # the registry's rest callback: after the tasks end


def record(rt: Runtime, conversation_id: str) -> dict[str, object]:
    agent = rt._registry.get(conversation_id)
    assert agent is not None
    return {name: getattr(agent, name) for name in ("id", *STORED)}


def test_every_agent_field_is_stored_dropped_or_settled() -> None:
    assert {"id", *STORED, *DROPPED, *SETTLED} == set(Agent.__slots__)
    assert not {*STORED} & {*DROPPED} and not {*STORED} & {*SETTLED}


def hibernated(conversation_id: str, i: int) -> Agent:
    agent = Agent(conversation_id, None)  # type: ignore[arg-type]
    agent.state = AgentState.SUSPENDED if i % 3 else AgentState.AWAITING_INPUT
    agent.head, agent.turn, agent.cycle, agent.restarts = 10**12 + i, i, i % 7, i % 4
    agent.calibration = 1.0 + i / 1000
    agent.topic = None if i % 2 else f"topic {i} \u00e9"
    agent.last_error = f"Boom: {i}" if i % 5 == 0 else None
    agent.pending = (f"call-{i}",) if i % 3 else ()
    agent.crash_times = (float(i),) if i % 4 == 0 else ()
    return agent


def test_dormant_table_gives_back_what_it_took_through_growth_reuse_and_compaction() -> None:
    table = DormantTable()
    ids = [f"conv-{i}-\u4e2d" if i % 9 == 0 else f"conv-{i}" for i in range(3000)]
    expected = {}
    for i, c in enumerate(ids):
        agent = hibernated(c, i)
        expected[c] = {name: getattr(agent, name) for name in STORED}
        table.put(agent)
    assert len(table) == 3000 and "conv-1" in table and "conv-x" not in table
    assert table.oldest_last_active() == expected[ids[0]]["last_active"]
    assert [a.id for a in table.peek()][:3] == ids[:3] and len(table) == 3000  # kept
    assert table.states() == {"awaiting_input": 1000, "suspended": 2000}
    order = list(ids)
    random.Random(9).shuffle(order)
    for n, c in enumerate(order):
        agent = table.take(c)
        assert agent is not None and agent.id == c
        assert {name: getattr(agent, name) for name in STORED} == expected[c]
        assert table.take(c) is None and c not in table
        if n % 3 == 0:  # rows and blob space are reused while others stay
            table.put(hibernated(c, ids.index(c)))
            assert table.take(c) is not None
    assert len(table) == 0 and table.take_oldest() is None


def test_samples_keep_the_last_ones_in_order() -> None:
    samples = Samples(3)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        samples.append(value)
    assert list(samples) == [3.0, 4.0, 5.0] and len(samples) == 3


async def test_a_hibernated_agent_goes_dormant_and_revives_with_its_state() -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        await (await rt.send("c", "one")).result()
        agent = rt._registry.get("c")
        assert agent is not None
        agent.restarts, agent.calibration = 2, 1.25  # what supervision and calls left
        agent.crash_times = (time.monotonic(),)
        del agent
        assert await rt.admin.hibernate("c")
        await settle()
        registry = rt._registry
        assert "c" not in registry.agents and len(registry.dormant) == 1 and len(registry) == 1
        before = {name: value for name, value in record(rt, "c").items()}  # rebuilt here
        assert before["restarts"] == 2 and before["calibration"] == 1.25
        assert len(registry.dormant) == 0 and "c" in registry.agents  # held again
        assert (await (await rt.send("c", "two")).result()).text == "echo: two"
        after = record(rt, "c")
        assert after["restarts"] == 2 and after["crash_times"] == before["crash_times"]
        assert after["turn"] == 2 and after["head"] == 3


async def test_admin_reads_dormant_agents_as_it_read_them_hibernated() -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        for c in ("a", "b", "c"):
            await (await rt.send(c, "hi")).result()
        held = [rt._registry.get(c) for c in ("a", "b", "c")]
        for agent in held:
            assert agent is not None
            rt._registry.hold(agent)  # keeps them objects
        for c in ("a", "b", "c"):
            assert await rt.admin.hibernate(c)
        await settle()
        assert len(rt._registry.dormant) == 0
        listed = await rt.admin.agents("hibernated")
        stats = await rt.admin.stats()
        for agent in held:
            assert agent is not None
            rt._registry.release(agent)
        rt._registry.rest_hibernated()
        assert len(rt._registry.dormant) == 3
        assert [i.conversation_id for i in await rt.admin.agents("hibernated")] == ["a", "b", "c"]

        def same(infos: list) -> list:  # type: ignore[type-arg]
            return [i.__class__(**{**{f: getattr(i, f) for f in i.__struct_fields__},
                                   "idle_seconds": None}) for i in infos]

        assert same(await rt.admin.agents("hibernated")) == same(listed)
        assert await rt.admin.agents("awaiting_input") != []
        again = await rt.admin.stats()
        assert (again.states, again.live, again.hibernated) == (
            stats.states, stats.live, stats.hibernated)
        assert len(rt._registry.dormant) == 3  # reading rebuilt nothing for good


async def test_a_suspended_agent_dormant_keeps_its_pending_call_and_resolves() -> None:
    from torpor import AgentConfig

    async with Runtime("sqlite://", model=approval_model(), config=QUIET,
                       agent=AgentConfig(tools=[APPROVE])) as rt:
        turn = await rt.send("s", "deploy it")
        await turn.result()
        del turn
        assert await rt.admin.hibernate("s")
        await settle()
        assert len(rt._registry.dormant) == 1
        info = await rt.admin.inspect("s")
        assert info.state == "suspended" and info.pending_calls == ("c1",)
        cont = await rt.resolve("s", "c1", "approved")
        assert cont is not None and (await cont.result()).text == "deployed"


async def test_eviction_takes_dormant_agents_oldest_first() -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        for c in ("a", "b", "c"):
            await (await rt.send(c, "hi")).result()
            assert await rt.admin.hibernate(c)
            await settle()
        assert len(rt._registry.dormant) == 3
        with rt.admin.watch() as watcher:
            since = rt._registry.oldest_hibernated_since()
            assert since is not None
            # As if only the first had idled past evict_after (a microsecond past it: the
            # sweep subtracts evict_after again, and (x + e) - e may round below x).
            assert await rt.admin.sweep(since + QUIET.evict_after + 1e-6) == (0, 1)
            assert "a" not in rt._registry and len(rt._registry) == 2
            assert (await watcher.__anext__()).new == "evicted"
        assert await rt.admin.evict("c") is True and len(rt._registry.dormant) == 1
        stats = await rt.admin.stats()
        assert stats.evictions == 2 and stats.live == 1
        assert (await (await rt.send("a", "back")).result()).text == "echo: back"


async def test_a_send_racing_the_move_to_dormant_keeps_the_agent_whole() -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        await (await rt.send("c", "one")).result()
        assert await rt.admin.hibernate("c")
        await settle()
        registry = rt._registry
        assert registry.get("c") is not None  # rebuilt, held, in the hibernated queue
        results = []

        async def send() -> None:
            results.append(await (await rt.send("c", "two")).result())

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            registry.rest("c")  # runs after the send took the agent: it must stay held
            await anyio.lowlevel.checkpoint()
            assert "c" in registry.agents and "c" not in registry.dormant
        assert results[0].text == "echo: two"
        info = await rt.admin.inspect("c")
        assert info.turn == 2 and info.head == 3 and info.live


async def test_an_agent_someone_holds_stays_an_object_until_the_last_holder_lets_go() -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        await (await rt.send("c", "one")).result()
        registry = rt._registry
        agent = registry.get("c")
        assert agent is not None
        registry.hold(agent)
        with registry.holding(agent):  # two holders
            assert await rt.admin.hibernate("c")
            await settle()
            assert registry.agents.get("c") is agent and len(registry.dormant) == 0
        await settle()
        assert registry.agents.get("c") is agent and len(registry.dormant) == 0  # one left
        await rt.admin.sweep()  # the sweep's retry leaves a held agent alone too
        assert registry.agents.get("c") is agent and len(registry.dormant) == 0
        registry.release(agent)
        await settle()  # the last release lets it go dormant, without waiting for a sweep
        assert "c" not in registry.agents and "c" in registry.dormant
        assert registry.get("c") is not agent  # rebuilt: a new object, the same agent
        assert record(rt, "c")["turn"] == 1


async def test_a_reference_alone_does_not_keep_an_agent_from_going_dormant() -> None:
    # Dormancy counts holders, not references (sys.getrefcount is no promise of CPython's):
    # a reference nobody declared, like this local, does not count.
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        await (await rt.send("c", "one")).result()
        agent = rt._registry.get("c")
        assert agent is not None
        assert await rt.admin.hibernate("c")
        await settle()
        assert "c" not in rt._registry.agents and "c" in rt._registry.dormant
        assert agent.id == "c"  # still referred to here


async def test_hibernation_drops_the_writer_head_cache_and_appends_stay_dense(
    tmp_path: object,
) -> None:
    async with Runtime("sqlite://", model=EchoModel(), config=QUIET) as rt:
        await (await rt.send("c", "one")).result()
        cache = rt._store._writer._cache._states  # type: ignore[attr-defined]
        assert "c" in cache
        assert await rt.admin.hibernate("c")
        await settle()
        assert "c" not in cache
        await (await rt.send("c", "two")).result()
        events = await rt.store.read_since("c", 0)
        assert [e.position for e in events] == list(range(len(events))) and len(events) == 4
