"""A library must not print: torpor logs through stdlib ``logging`` under ``torpor``, or not at all.

The silent case runs in a subprocess: "nothing on stdout or stderr" is only
observable from outside a process that has configured nothing (pytest itself
configures logging). The configured cases run here, with a handler of their own.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import structlog

from torpor import AgentConfig, EchoModel, Event, Runtime, RuntimeConfig, TurnAborted
from torpor._logging import get_logger

ROOT = Path(__file__).resolve().parents[1]

# A runtime's life in miniature: turns, an eviction, a crash restarted from the log,
# a crash loop parked. Every level torpor logs at is reached (debug from the store,
# warning for the crash, error for the park). Figures go to a file: stdout must stay empty.
SCENARIO = textwrap.dedent(
    """
    import asyncio, inspect, json, sys
    from collections.abc import Sequence
    from torpor import (AgentConfig, AgentParked, EchoModel, Event, Runtime, RuntimeConfig,
                        TurnAborted)

    async def maybe(value):  # admin methods are becoming coroutines: work either way
        return await value if inspect.isawaitable(value) else value

    class FailsOnce:
        failed = False
        async def summarize(self, previous: str, events: Sequence[Event]) -> str:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("summarizer hiccup")
            return "summary"

    class AlwaysFails:
        async def summarize(self, previous: str, events: Sequence[Event]) -> str:
            raise RuntimeError("summarizer is down")

    ONCE = AgentConfig(summarizer=FailsOnce(), working_budget=40, tail_turns=1)
    ALWAYS = AgentConfig(summarizer=AlwaysFails(), working_budget=40, tail_turns=1)
    PLAIN = AgentConfig()

    def agent_for(conversation_id: str) -> AgentConfig:
        return {"once": ONCE, "always": ALWAYS}.get(conversation_id, PLAIN)

    async def crash(rt, conversation_id: str) -> None:
        turn = await rt.send(conversation_id, "a message long enough to force a fold " * 4)
        try:
            await turn.result()
        except TurnAborted as exc:
            assert exc.reason == "crashed", exc
        else:
            raise AssertionError("expected a crash")

    async def main(url: str, out: str) -> None:
        config = RuntimeConfig(max_restarts=1, restart_window=3600, backoff_initial=0.0)
        async with Runtime(url, model=EchoModel(), config=config, agent_for=agent_for) as rt:
            for i in range(3):
                assert (await (await rt.send("plain", f"hello {i}")).result()).text
            evicted = await maybe(rt.admin.evict("plain"))
            assert (await (await rt.send("plain", "back again")).result()).text

            await (await rt.send("once", "a first message with several words " * 3)).result()
            await crash(rt, "once")
            # The restarted agent (FailsOnce no longer fails) answers from the log.
            assert (await (await rt.send("once", "after the restart " * 4)).result()).text

            watcher = await maybe(rt.admin.watch())
            with watcher:
                await (await rt.send("always", "a first message with several words " * 3)).result()
                await crash(rt, "always")
                await crash(rt, "always")
                async for t in watcher:
                    if t.conversation_id == "always" and t.new == "parked":
                        break
            stats = await maybe(rt.admin.stats())
        with open(out, "w") as f:
            json.dump({"evicted": evicted, "crashes": stats.crashes,
                       "restarts": stats.restarts, "parks": stats.parks,
                       "evictions": stats.evictions}, f)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_an_unconfigured_host_sees_nothing_on_stdout_or_stderr(tmp_path: Path) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    figures = tmp_path / "figures.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "TORPOR"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'log.db'}", str(figures)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr == ""
    # The scenario really went through what logs: an eviction, a restart, a park.
    stats = json.loads(figures.read_text())
    assert stats["evicted"] is True and stats["evictions"] >= 1
    assert stats["crashes"] == 3 and stats["restarts"] == 2 and stats["parks"] == 1


# -- a host that configures logging ---------------------------------------------------------


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def named(self, message: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.getMessage().startswith(message)]


@pytest.fixture
def capture() -> Iterator[Capture]:
    """A handler on the ``torpor`` logger at DEBUG, as a host would add one."""
    handler = Capture()
    logger = logging.getLogger("torpor")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logging.disable(logging.NOTSET)


class AlwaysFails:
    async def summarize(self, previous: str, events: Sequence[Event]) -> str:
        raise RuntimeError("summarizer is down")


async def crash_once(url: str, conversation_id: str) -> None:
    agent = AgentConfig(summarizer=AlwaysFails(), working_budget=40, tail_turns=1)
    config = RuntimeConfig(max_restarts=5, backoff_initial=0.0)
    async with Runtime(url, model=EchoModel(), agent=agent, config=config) as rt:
        await (await rt.send(conversation_id, "a first message with several words " * 3)).result()
        turn = await rt.send(conversation_id, "a message long enough to force a fold " * 4)
        with pytest.raises(TurnAborted):
            await turn.result()


async def test_records_reach_the_host_with_their_bound_context(
    capture: Capture, tmp_path: Path
) -> None:
    await crash_once(f"sqlite:///{tmp_path / 'log.db'}", "conv-1")

    assert capture.records and all(r.name.startswith("torpor.") for r in capture.records)
    [crashed] = capture.named("agent_crashed")
    assert crashed.name == "torpor.runtime" and crashed.levelno == logging.WARNING
    assert crashed.conversation_id == "conv-1"  # type: ignore[attr-defined]
    assert "summarizer is down" in crashed.error  # type: ignore[attr-defined]
    assert crashed.exc_info is not None and crashed.exc_info[0] is RuntimeError
    assert "conversation_id='conv-1'" in crashed.getMessage()  # a plain formatter shows it too
    # Context bound once with log.bind(...) rides on every record of that logger.
    store_records = [r for r in capture.records if r.name == "torpor.store.sqlite.store"]
    assert store_records and all(
        r.store.endswith("log.db") for r in store_records  # type: ignore[attr-defined]
    )
    assert any(r.levelno == logging.DEBUG for r in capture.records)  # the host chose DEBUG


async def test_logging_disable_silences_torpor(capture: Capture, tmp_path: Path) -> None:
    logging.disable(logging.CRITICAL)
    await crash_once(f"sqlite:///{tmp_path / 'log.db'}", "conv-2")
    assert capture.records == []


async def test_host_levels_apply(capture: Capture, tmp_path: Path) -> None:
    logging.getLogger("torpor").setLevel(logging.WARNING)
    await crash_once(f"sqlite:///{tmp_path / 'log.db'}", "conv-3")
    assert capture.named("agent_crashed")
    assert all(r.levelno >= logging.WARNING for r in capture.records)


def test_structlog_configured_by_the_host_does_not_make_torpor_print() -> None:
    saved = structlog.get_config()
    printed = io.StringIO()
    try:
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(printed),
                            wrapper_class=structlog.make_filtering_bound_logger(0))
        get_logger("torpor.test").warning("hello", key="value")
    finally:
        structlog.configure(**saved)
    assert printed.getvalue() == ""


# -- a logging call never raises -----------------------------------------------------------


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


def test_a_logging_call_cannot_raise_into_its_caller(capture: Capture) -> None:
    log = get_logger("torpor.test").bind(conversation_id="c\ud800\n")  # lone surrogate, newline
    log.warning("odd values", value=BrokenRepr(), name="clash", message="clash", args=(1,))
    [record] = capture.records
    text = record.getMessage()
    text.encode("utf-8")  # escaped: any handler can write it
    assert "\n" not in text and "conversation_id='c\\ud800\\n'" in text
    assert "value=<BrokenRepr: repr raised RuntimeError>" in text
    assert record.conversation_id == "c\ud800\n"  # type: ignore[attr-defined]
    assert record.name == "torpor.test" and record.name_ == "clash"  # type: ignore[attr-defined]
    assert record.message_ == "clash" and record.args_ == (1,)  # type: ignore[attr-defined]

    class Exploding(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("a host filter that raises")

    logger = logging.getLogger("torpor.test")
    exploding = Exploding()
    logger.addFilter(exploding)
    try:
        log.error("still fine")  # returns, whatever the host's logging does
    finally:
        logger.removeFilter(exploding)
    log.info("bad format %s %s", 1)  # too few arguments: a minimal record instead
    assert capture.records[-1].getMessage().startswith("bad format %s %s (record dropped")


def test_a_handler_that_cannot_encode_does_not_reach_the_caller(
    capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # strict errors
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s %(conversation_id)s"))
    monkeypatch.setattr(logging, "raiseExceptions", False)  # as in production
    logger = logging.getLogger("torpor.test")
    logger.addHandler(handler)
    try:
        get_logger("torpor.test").error("x", conversation_id="\udc80")
    finally:
        logger.removeHandler(handler)
    assert capture.records  # the call returned; the handler's error stayed in logging


def test_records_name_the_line_that_logged(capture: Capture) -> None:
    get_logger("torpor.test").info("where")
    [record] = capture.records
    assert record.filename == "test_logging.py" and record.funcName == inspect.stack()[0][3]


def test_names_outside_torpor_are_put_under_it(capture: Capture) -> None:
    get_logger("__main__").info("from a script")
    assert [r.name for r in capture.records] == ["torpor.__main__"]


def test_no_module_bypasses_the_torpor_logger() -> None:
    """Every module logs through torpor._logging; only the CLI (an application) configures."""
    anywhere = re.compile(r"structlog\.(get_logger|configure|wrap_logger)\(")
    outside_cli = re.compile(r"\blogging\.(getLogger|basicConfig)\(|\bprint\(")
    offenders: list[str] = []
    for path in sorted((ROOT / "torpor").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "torpor/_logging.py":
            continue
        source = path.read_text()
        found = anywhere.findall(source)
        if not relative.startswith("torpor/cli/"):
            found += outside_cli.findall(source)
        offenders += [f"{relative}: {match}" for match in found]
    assert offenders == []
