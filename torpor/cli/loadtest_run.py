"""The load test's runtime phases: activate every agent, run a mixed load, probe memory per state.

Phases, all inside one :class:`~torpor.Runtime`:

1. **activate**: every conversation receives one message, so every agent is
   revived from its log and holds a working set. The RSS growth over the
   phase, divided by N, is the cost of an active agent.
2. **run** (``duration`` seconds): a fraction R of the agents take turns back
   to back; a trickle of "returning users" wakes random idle ones; everyone
   else sits idle while the lifecycle sweep hibernates and then evicts them
   on a schedule compressed to fit the run. Agents per state and RSS are
   sampled from ``rt.admin.stats()`` throughout.
3. **probe**: K evicted agents are walked through active -> hibernated ->
   evicted under tracemalloc, which (unlike RSS, which freed memory rarely
   lowers) measures each state exactly.

Every phase runs under the command's wall-clock bound (see
:mod:`torpor.cli.loadtest_phases`); the sections of the result a cut run did
not reach stay ``None``, and an interrupted run phase still reports its figures
so far. The runtime closes after the bound, timed as the ``close`` phase.
"""

from __future__ import annotations

import asyncio
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import msgspec

from torpor.cli.loadtest_phases import Phases
from torpor.cli.memory import peak_rss_bytes, rss_bytes, settle
from torpor.cli.progress import Progress
from torpor.errors import TorporError
from torpor.llm.echo import EchoModel
from torpor.runtime import Runtime, RuntimeConfig, RuntimeStats
from torpor.runtime.stats import percentile

__all__ = ["RunPlan", "RunResult", "Sample", "run_phases"]


class RunPlan(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    conversation_ids: tuple[str, ...]
    active_ratio: float
    duration: float
    config: RuntimeConfig
    wake_rate: float = 20.0  # messages per second to random idle conversations
    think_time: float = 0.0  # pause of a driven agent between its turns
    probe_agents: int = 1000
    seed: int = 0


class Sample(msgspec.Struct, frozen=True):
    t: float  # seconds since activation began
    phase: str
    with_working_set: int
    hibernated: int
    evicted: int  # of the load test's conversations, those not in memory
    busy: int  # reviving, streaming or running tools
    live: int
    tasks: int
    rss_bytes: int
    turns: int
    states: dict[str, int]


class RunResult(msgspec.Struct, kw_only=True):
    """The figures per section; a section whose phase a timed-out run never reached is None."""

    activation: dict[str, float | int | None] | None = None
    run: dict[str, float | int | dict[str, int] | None] | None = None
    lifecycle: dict[str, float | int | None] | None = None
    memory: dict[str, float | int | None] | None = None
    timeline: list[Sample] = []


class _Tally:
    """What the load generators have done so far."""

    def __init__(self) -> None:
        self.turns = 0
        self.turn_seconds: list[float] = []
        self.wakes = 0
        self.wake_seconds: list[float] = []
        self.errors: Counter[str] = Counter()


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


class _Sampler:
    """Samples agents per state and RSS at a fixed interval, plus on demand at phase edges."""

    def __init__(self, rt: Runtime, total: int, tally: _Tally, every: float) -> None:
        self._rt = rt
        self._total = total
        self._tally = tally
        self._every = every
        self._origin = time.perf_counter()
        self.phase = "activate"
        self.samples: list[Sample] = []

    async def take(self) -> Sample:
        stats = await self._rt.admin.stats()
        busy = sum(stats.states.get(s, 0) for s in ("reviving", "streaming", "running_tools"))
        sample = Sample(
            t=round(time.perf_counter() - self._origin, 3),
            phase=self.phase,
            with_working_set=stats.with_working_set,
            hibernated=stats.hibernated,
            evicted=max(0, self._total - stats.live),
            busy=busy,
            live=stats.live,
            tasks=stats.tasks,
            rss_bytes=rss_bytes(),
            turns=self._tally.turns,
            states=dict(stats.states),
        )
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while True:
            await self.take()
            await asyncio.sleep(self._every)


async def _activate(rt: Runtime, ids: Sequence[str], progress: Progress, tally: _Tally) -> None:
    progress.phase("activate", len(ids))

    async def one(conversation_id: str) -> None:
        try:
            turn = await rt.send(conversation_id, "Hello again, I am back.")
            await turn.result()
        except TorporError as exc:
            tally.errors[type(exc).__name__] += 1
        progress.advance()

    async with asyncio.TaskGroup() as group:
        for conversation_id in ids:
            group.create_task(one(conversation_id))
    progress.done()


async def _drive(rt: Runtime, conversation_id: str, deadline: float, think: float,
                 tally: _Tally) -> None:
    n = 0
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            turn = await rt.send(conversation_id, f"Turn {n}: anything new on my request?")
            await turn.result()
        except TorporError as exc:
            tally.errors[type(exc).__name__] += 1
        else:
            tally.turns += 1
            tally.turn_seconds.append(time.perf_counter() - started)
        n += 1
        if think > 0:
            await asyncio.sleep(think)


async def _wake(rt: Runtime, conversation_id: str, tally: _Tally) -> None:
    started = time.perf_counter()
    try:
        turn = await rt.send(conversation_id, "Me again, after a while.")
        await turn.result()
    except TorporError as exc:
        tally.errors[type(exc).__name__] += 1
    else:
        tally.wakes += 1
        tally.wake_seconds.append(time.perf_counter() - started)


async def _returning_users(rt: Runtime, idle: Sequence[str], rate: float, deadline: float,
                           rng: random.Random, tally: _Tally) -> None:
    if rate <= 0 or not idle:
        return
    sent = 0
    started = time.monotonic()
    async with asyncio.TaskGroup() as group:
        while (now := time.monotonic()) < deadline:
            due = int((now - started) * rate) - sent
            for _ in range(due):
                group.create_task(_wake(rt, rng.choice(idle), tally))
            sent += max(0, due)
            await asyncio.sleep(min(0.05, 1 / rate))


def _split(plan: RunPlan) -> tuple[list[str], list[str]]:
    """(driven, idle): a seeded random fraction R of the conversations takes turns."""
    ids = plan.conversation_ids
    driven = random.Random(plan.seed).sample(list(ids), round(len(ids) * plan.active_ratio))
    chosen = set(driven)
    return driven, [c for c in ids if c not in chosen]


async def _run_load(rt: Runtime, plan: RunPlan, driven: Sequence[str], idle: Sequence[str],
                    progress: Progress, tally: _Tally,
                    figures: dict[str, float | int | dict[str, int] | None]) -> None:
    """Drive the load for ``plan.duration``; ``figures`` is filled in even if the bound cuts
    the phase short, with what it did until then."""
    rng = random.Random(plan.seed + 1)
    progress.phase("run", plan.duration)
    started = time.monotonic()
    deadline = started + plan.duration

    async def ticker() -> None:
        while (now := time.monotonic()) < deadline:
            progress.update(now - started)
            await asyncio.sleep(0.2)

    turns_before = tally.turns
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(ticker())
            group.create_task(_returning_users(rt, idle, plan.wake_rate, deadline, rng, tally))
            for conversation_id in driven:
                group.create_task(_drive(rt, conversation_id, deadline, plan.think_time, tally))
    finally:
        seconds = time.monotonic() - started
        progress.done()
        turns = tally.turns - turns_before
        figures.update({
            "seconds": round(seconds, 3),
            "driven_agents": len(driven),
            "turns": turns,
            "turns_per_second": round(turns / seconds, 1) if seconds > 0 else None,
            "turn_p50_ms": _ms(percentile(tally.turn_seconds, 50)),
            "turn_p99_ms": _ms(percentile(tally.turn_seconds, 99)),
            "wakes": tally.wakes,
            "wake_p50_ms": _ms(percentile(tally.wake_seconds, 50)),
            "wake_p99_ms": _ms(percentile(tally.wake_seconds, 99)),
            "errors": dict(tally.errors),
        })


async def _until(predicate: Callable[[], Awaitable[bool]], limit: float = 30.0) -> None:
    """Poll until agents' tasks have acted on a lifecycle request (they do so asynchronously).

    The runtime has no event for "every agent task has exited", so this polls
    (it is a measurement tool, not a synchronisation primitive a test relies on).
    """
    deadline = time.monotonic() + limit
    while not await predicate() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def _evict_everything(rt: Runtime) -> None:
    await rt.admin.sweep(time.monotonic() + rt.config.evict_after + 1)
    await _until(lambda: _no_tasks(rt))


async def _no_tasks(rt: Runtime) -> bool:
    return (await rt.admin.stats()).tasks == 0


async def _probe(
    rt: Runtime, ids: Sequence[str], progress: Progress
) -> dict[str, float | int | None]:
    """Per-state bytes of K agents: tracemalloc for every state, RSS for the upward step."""
    await _evict_everything(rt)
    k = len(ids)
    progress.phase("probe", 3)
    settle()
    tracemalloc.start()
    try:
        base_traced, base_rss = tracemalloc.get_traced_memory()[0], rss_bytes()

        async def one(conversation_id: str) -> None:
            await (await rt.send(conversation_id, "A quick question for the probe.")).result()

        async with asyncio.TaskGroup() as group:
            for conversation_id in ids:
                group.create_task(one(conversation_id))
        settle()
        active_traced, active_rss = tracemalloc.get_traced_memory()[0], rss_bytes()
        progress.advance()
        for conversation_id in ids:
            await rt.admin.hibernate(conversation_id)
        await _until(lambda: _no_tasks(rt))
        settle()
        hibernated_traced, hibernated_rss = tracemalloc.get_traced_memory()[0], rss_bytes()
        progress.advance()
        for conversation_id in ids:
            await rt.admin.evict(conversation_id)
        settle()
        evicted_traced, evicted_rss = tracemalloc.get_traced_memory()[0], rss_bytes()
        progress.advance()
    finally:
        tracemalloc.stop()
    progress.done()
    return {
        "probe_agents": k,
        "probe_active_traced_bytes_per_agent": round((active_traced - base_traced) / k),
        "probe_hibernated_traced_bytes_per_agent": round((hibernated_traced - base_traced) / k),
        "probe_evicted_traced_bytes_per_agent": round((evicted_traced - base_traced) / k),
        "probe_active_rss_bytes_per_agent": round((active_rss - base_rss) / k),
        "probe_hibernated_rss_bytes_per_agent": round((hibernated_rss - base_rss) / k),
        "probe_evicted_rss_bytes_per_agent": round((evicted_rss - base_rss) / k),
    }


def _lifecycle(stats: RuntimeStats) -> dict[str, float | int | None]:
    return {
        "activations": stats.activations,
        "revivals": stats.revivals,
        "hibernations": stats.hibernations,
        "evictions": stats.evictions,
        "crashes": stats.crashes,
        "restarts": stats.restarts,
        "parks": stats.parks,
        "revival_p50_ms": stats.revival_p50_ms,
        "revival_p99_ms": stats.revival_p99_ms,
    }


async def _stop(task: asyncio.Task[Any]) -> None:
    """Cancel a helper task and wait until it has ended. ``asyncio.wait`` rather than awaiting
    the task: the task's CancelledError must not be confused with (and swallow) our own."""
    task.cancel()
    await asyncio.wait([task])


async def _measure(rt: Runtime, plan: RunPlan, progress: Progress, phases: Phases,
                   tally: _Tally, result: RunResult) -> None:
    """The three phases, each section of ``result`` set as soon as its phase has ended."""
    ids = plan.conversation_ids
    n = len(ids)
    driven, idle = _split(plan)
    settle()
    rss_before = rss_bytes()
    memory: dict[str, float | int | None] = {"rss_before_activation_bytes": rss_before}
    sampler = _Sampler(rt, n, tally, every=max(0.1, plan.duration / 60))
    result.timeline = sampler.samples  # filled as it samples: a cut run keeps its samples
    sampling = asyncio.create_task(sampler.run())
    try:
        with phases.timed("activate"):
            started = time.perf_counter()
            await _activate(rt, ids, progress, tally)
            activation_seconds = time.perf_counter() - started
        activated = await rt.admin.stats()
        settle()
        rss_active = rss_bytes()
        memory["rss_after_activation_bytes"] = rss_active
        memory["active_rss_bytes_per_agent"] = round((rss_active - rss_before) / n) if n else None
        memory["working_set_bytes_estimated_per_agent"] = (
            round(activated.working_set_bytes / activated.with_working_set)
            if activated.with_working_set else None
        )
        result.memory = memory
        result.activation = {
            "agents": n,
            "seconds": round(activation_seconds, 3),
            "agents_per_second": (round(n / activation_seconds, 1)
                                  if activation_seconds > 0 else None),
            "revival_p50_ms": activated.revival_p50_ms,
            "revival_p99_ms": activated.revival_p99_ms,
            "revivals": activated.revivals,  # so far: the window covers the last 4,096
            "errors": sum(tally.errors.values()),
        }
        await sampler.take()
        sampler.phase = "run"
        result.run = {}
        with phases.timed("run"):
            await _run_load(rt, plan, driven, idle, progress, tally, result.run)
        await sampler.take()
        result.lifecycle = _lifecycle(await rt.admin.stats())
    finally:
        await _stop(sampling)
        memory["rss_end_of_run_bytes"] = rss_bytes()
        memory["peak_rss_bytes"] = peak_rss_bytes()
    probe_ids = idle[: plan.probe_agents]  # never driven: a typical working set
    if probe_ids:
        with phases.timed("probe"):
            memory.update(await _probe(rt, probe_ids, progress))
        memory["peak_rss_bytes"] = peak_rss_bytes()


async def run_phases(plan: RunPlan, progress: Progress, phases: Phases) -> RunResult:
    """Activate, run and probe inside one runtime, within the bound of ``phases``; the
    runtime then closes (ending any turn the bound cut), timed as the ``close`` phase."""
    tally = _Tally()
    result = RunResult()
    async with AsyncExitStack() as stack:  # closes the runtime on an unexpected error too
        rt: Runtime | None = None
        async with phases.bound():
            rt = await stack.enter_async_context(
                Runtime(plan.url, model=EchoModel(), config=plan.config)
            )
            await _measure(rt, plan, progress, phases, tally, result)
        if rt is not None:
            with phases.timed("close"):
                await stack.aclose()
    return result
