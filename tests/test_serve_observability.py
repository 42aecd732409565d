"""Issue 22: what an operator and a UI get from a served runtime with no wiring at all.

Over real HTTP: a 429 from the model ends the turn with an ``aborted`` event whose
body says what a UI decides on (error, retryable, retry_after, status, a fixed
message, no provider text), one warning record, and labelled metrics whose error
series existed at zero before the first error; a conversation's own model and its
tools are labelled by name; pending approvals include evicted conversations; the
fields read back the same after a restart.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_support import ADMIN, events_until, post_message, served

import torpor
from torpor import AgentConfig, ExternalTool, ModelRateLimited, Runtime, ScriptedModel
from torpor.errors import MODEL_ERROR_MESSAGES
from torpor.llm.scripted import Call, Fail, Signal, Text, Wait
from torpor.serve.client import Client, SSEEvent
from torpor.serve.metrics import MODEL_ERROR_TYPES

PROVIDER_TEXT = "LiteLLM: model group 'mock-429' failed; see https://docs.example/limits"
RATE_LIMITED = ModelRateLimited(PROVIDER_TEXT, provider="litellm", status=429, retry_after=7.0)
APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})


def ended(event: SSEEvent) -> bool:
    """The turn's last event: a final answer (no tool calls), a suspension, an abort."""
    if event.event == "assistant":
        return not event.json()["body"].get("tool_calls")
    return event.event in ("aborted", "suspended")


async def scrape(client: Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    _, response = await client.open("GET", "/metrics", token=ADMIN)
    text = (await response.read()).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def aborted_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("turn_aborted")]


async def test_a_429_gives_a_structured_aborted_event_one_warning_and_labelled_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="torpor")
    model = ScriptedModel([[Text("par"), Fail(RATE_LIMITED)]], name="gpt-test")
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        before = await scrape(client)
        # every error type's series exists at zero before any call: alerts work from the start
        for kind in MODEL_ERROR_TYPES:
            assert value(before, "torpor_model_errors_total", model="gpt-test", type=kind) == 0
        assert value(before, "torpor_turns_aborted_total", reason="model_error",
                     error="ModelRateLimited") == 0
        assert value(before, "torpor_turns_aborted_total", reason="shutdown",
                     error="none") == 0
        assert value(before, "torpor_model_call_seconds_count", model="gpt-test") == 0

        conn, response = await post_message(client, "r", "hello")
        events = await events_until(response, ended)
        await conn.close()
        assert events[-1].event == "aborted"
        body = events[-1].json()["body"]
        assert body["reason"] == "model_error" and body["error"] == "ModelRateLimited"
        assert body["retryable"] is True and body["retry_after"] == 7.0
        assert body["status"] == 429
        assert body["message"] == MODEL_ERROR_MESSAGES["ModelRateLimited"]
        assert "LiteLLM" not in body["message"] and "https" not in body["message"]
        assert "LiteLLM" in body["detail"]  # the operator's copy
        assert body["partial_text"] == "par"

        warnings = [r for r in aborted_records(caplog) if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        (record,) = warnings
        assert (record.conversation_id, record.turn, record.reason, record.error,  # type: ignore[attr-defined]
                record.status, record.retryable) == (  # type: ignore[attr-defined]
            "r", 1, "model_error", "ModelRateLimited", 429, True)

        after = await scrape(client)
        assert value(after, "torpor_model_call_seconds_count", model="gpt-test") == 1
        assert value(after, "torpor_model_errors_total", model="gpt-test",
                     type="ModelRateLimited") == 1
        assert value(after, "torpor_turns_aborted_total", reason="model_error",
                     error="ModelRateLimited") == 1
        assert value(after, "torpor_time_to_first_token_seconds_count", model="gpt-test") == 1


async def test_a_cancel_is_logged_at_info_not_as_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="torpor")
    reached = anyio.Event()
    model = ScriptedModel([[Text("partial"), Signal(reached), Wait(anyio.Event())]])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        conn, response = await post_message(client, "c", "go")
        await reached.wait()
        assert await client.call("POST", "/v1/conversations/c/cancel") == {"cancelled": True}
        events = await events_until(response, ended)
        await conn.close()
        body = events[-1].json()["body"]
        assert (body["reason"], body["error"], body["retryable"]) == ("cancelled", None, False)
        after = await scrape(client)
    assert [r.levelno for r in aborted_records(caplog)] == [logging.INFO]
    assert value(after, "torpor_turns_aborted_total", reason="cancelled", error="none") == 1


@torpor.tool
async def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: shipped"


@torpor.tool
async def broken(order: str) -> str:
    """A tool that fails."""
    raise RuntimeError("database on fire")


async def test_a_conversations_own_model_and_its_tools_are_labelled_by_name() -> None:
    special = ScriptedModel([
        [Call("lookup", {"order": "A1"}, id="k1"), Call("broken", {"order": "A1"}, id="k2")],
        "done",
    ], name="special-model")

    def agent_for(conversation_id: str) -> AgentConfig:
        if conversation_id == "vip":
            return AgentConfig(model=special, tools=[lookup, broken])
        return AgentConfig()

    async with Runtime("sqlite://", model=ScriptedModel.replies("plain", name="default-model"),
                       agent_for=agent_for) as rt, served(rt) as (_, client, _app):
        before = await scrape(client)
        assert value(before, "torpor_model_call_seconds_count", model="default-model") == 0
        conn, response = await post_message(client, "vip", "where is A1?")
        events = await events_until(response, ended)
        await conn.close()
        assert events[-1].event == "assistant"
        after = await scrape(client)
    assert value(after, "torpor_model_call_seconds_count", model="special-model") == 2
    assert value(after, "torpor_model_errors_total", model="special-model",
                 type="ModelTimeout") == 0  # a new model gets its zero series too
    assert value(after, "torpor_model_call_seconds_count", model="default-model") == 0
    assert value(after, "torpor_tool_calls_total", tool="lookup") == 1
    assert value(after, "torpor_tool_calls_total", tool="broken") == 1
    assert value(after, "torpor_tool_call_seconds_count", tool="lookup") == 1
    assert value(after, "torpor_tool_errors_total", tool="broken") == 1
    assert value(after, "torpor_tool_errors_total", tool="lookup") == 0


async def test_pending_approvals_count_an_evicted_suspended_conversation() -> None:
    model = ScriptedModel([[Call("approve", {}, id="p1")]], loop=True)
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[APPROVE])) as rt, served(rt) as (
                           _, client, _app):
        before = await scrape(client)
        assert value(before, "torpor_pending_approvals") == 0
        assert value(before, "torpor_pending_approval_oldest_seconds") == 0
        for cid in ("p", "q"):
            conn, response = await post_message(client, cid, "pay")
            events = await events_until(response, ended)
            await conn.close()
            assert events[-1].event == "suspended"
        assert await rt.admin.evict("p")
        assert (await rt.admin.inspect("p")).live is False
        after = await scrape(client)
        summary = await rt.store.pending_summary()
        listed = await rt.admin.pending()
    assert value(after, "torpor_pending_approvals") == 2
    assert value(after, "torpor_pending_calls") == 2
    oldest = value(after, "torpor_pending_approval_oldest_seconds")
    assert oldest is not None and oldest >= 0
    assert summary.oldest == min(a.since for a in listed)


async def test_the_structured_fields_read_back_the_same_after_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    async with Runtime(url, model=ScriptedModel([[Fail(RATE_LIMITED)]])) as rt:
        turn = await rt.send("r", "hello", key="k-1")
        with pytest.raises(torpor.TurnAborted) as live:
            await turn.result()
    assert live.value.error_type == "ModelRateLimited" and live.value.status == 429
    async with Runtime(url, model=ScriptedModel.replies("unused")) as rt, served(rt) as (
        _, client, _app
    ):
        page = await client.call("GET", "/v1/conversations/r/history")
        (aborted,) = [e["body"] for e in page["events"] if e["kind"] == "aborted"]
        assert (aborted["error"], aborted["retryable"], aborted["retry_after"],
                aborted["status"], aborted["message"]) == (
            "ModelRateLimited", True, 7.0, 429, MODEL_ERROR_MESSAGES["ModelRateLimited"])
        # the same message sent again with its key: the turn is replayed from the log
        replayed = await rt.send("r", "hello", key="k-1")
        assert replayed.replayed
        with pytest.raises(torpor.TurnAborted) as again:
            await replayed.result()
    assert again.value.fields == live.value.fields
    assert again.value.error is None  # replayed: no live exception behind it


async def test_top_shows_model_errors_aborted_turns_and_pending_approvals() -> None:
    """During a run where turns failed, ``torpor top`` says so (it showed ``crashes / parks
    0 / 0``), and none of its titles wraps, at 140 columns or fewer."""
    from torpor.cli.top import Top

    model = ScriptedModel([[Fail(RATE_LIMITED)], [Fail(RATE_LIMITED)],
                           [Call("approve", {}, id="p1")]])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[APPROVE])) as rt, served(rt) as (
                           url, client, _app):
        for cid in ("f1", "f2", "w"):
            conn, response = await post_message(client, cid, "hi")
            await events_until(response, ended)
            await conn.close()
        top = Top(url, ADMIN)
        await top.refresh()
    assert top.connected
    titles = ("agents per state", "runtime", "failures", "busiest (last 10 s)", "parked")
    for width in (140, 80, 40):
        lines = _rendered(top, width).splitlines()
        assert lines[0].startswith("torpor top  http") and len(lines[0]) <= width
        assert lines[1].strip() == "agents per state"  # the title took one line
        for title in titles:  # each title whole on a line of its own
            assert any(line.strip() == title for line in lines), (width, title)
    text = _rendered(top, 140)
    assert "model errors" in text and "2 (ModelRateLimited 2)" in text
    assert "aborted turns" in text and "2 (model_error 2)" in text
    assert "pending approvals" in text and "1 (oldest" in text


def _rendered(top: object, width: int) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(top.render())  # type: ignore[attr-defined]
    return out.getvalue()


async def test_a_stopped_app_no_longer_measures_the_runtime_it_served() -> None:
    """The observer goes with the app (the runtime may outlive it, and serve another)."""
    from torpor.serve import Metrics

    metrics = Metrics(process=False)
    async with Runtime("sqlite://", model=ScriptedModel.replies("a", "b", name="m")) as rt:
        async with served(rt, metrics=metrics) as (_, client, _app):
            conn, response = await post_message(client, "s", "one")
            await events_until(response, ended)
            await conn.close()
        count = {"model": "m"}
        assert metrics.registry.get_sample_value("torpor_model_call_seconds_count", count) == 1
        assert metrics.observing == 0
        await (await rt.send("s", "two")).result()
        assert metrics.registry.get_sample_value("torpor_model_call_seconds_count", count) == 1


def test_the_log_tap_follows_the_hosts_levels_set_after_it_was_installed() -> None:
    """The tap lowers the writers' loggers to DEBUG to read group commits; what reaches the
    host's handlers must still follow the host's levels, also ones set after the tap."""
    from prometheus_client import generate_latest

    from torpor._logging import event_of, get_logger
    from torpor.serve.metrics import LogTap

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root = logging.getLogger("torpor")
    handler, before = Keep(), root.level
    root.addHandler(handler)
    metrics = torpor.serve.Metrics()
    tap = LogTap(metrics)
    try:
        root.setLevel(logging.DEBUG)
        tap.install()
        root.setLevel(logging.WARNING)  # the host quietens torpor after the app started
        writer = get_logger("torpor.store.sqlite.writer")
        writer.debug("group_commit", ops=3, failed=0, seconds=0.001)
        writer.warning("slow_disk")
    finally:
        tap.uninstall()
        root.removeHandler(handler)
        root.setLevel(before)
    assert [event_of(r) for r in seen] == ["slow_disk"]
    assert "torpor_group_commit_batch_size_count 1.0" in generate_latest(metrics.registry).decode()


def test_two_apps_taps_keep_the_hosts_level_whichever_leaves_first() -> None:
    from torpor._logging import get_logger, stdlib_logger
    from torpor.serve.metrics import LogTap

    writer = stdlib_logger("torpor.store.sqlite.writer")
    first, second = LogTap(torpor.serve.Metrics()), LogTap(torpor.serve.Metrics())
    before = writer.level
    try:
        first.install()
        second.install()  # over the first: the host's level is still what it was before both
        first.uninstall()
        assert writer.level == logging.DEBUG  # the second still reads group commits
        seen: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = seen.append  # type: ignore[method-assign]
        root = logging.getLogger("torpor")
        old = root.level
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
        try:
            get_logger("torpor.store.sqlite.writer").debug("group_commit", ops=1, failed=0,
                                                           seconds=0.001)
        finally:
            root.removeHandler(handler)
            root.setLevel(old)
        assert seen == []
    finally:
        second.uninstall()
        first.uninstall()
    assert writer.level == before
