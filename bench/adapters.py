"""Provider adapters: torpor's cost per turn and per streamed delta over real HTTP, against
calling the SDK directly; and the bytes re-sent per turn with and without folding.

Question 1: what does a turn cost on top of the provider's own time? A replay
server (tests/replay.py, in a process of its own, on 127.0.0.1) streams each
provider's wire format and reports its own time per request (request read to
last byte written). For each provider, three clients take the same turns through
the same official SDK client, in the same run:

* ``sdk``: the SDK called directly, the way a hand-written chat loop does it
  (a list of message dicts, ``create(stream=True)``, text joined from the chunks);
* ``adapter``: torpor's adapter alone (``model.stream(context, tools)``), no runtime;
* ``torpor``: a full turn through the runtime (log appends on a SQLite file,
  context assembly, audit row, fan-out to the caller).

*Overhead per turn* is the client's wall time per turn minus the server's time
for that request (what is left: SDK, adapter, runtime, loopback). Runs with few
and with many deltas per answer give the *cost per streamed delta* (the slope).

Question 2: how many bytes does each turn re-send, for a 200-turn conversation,
without folding and with it (the default working budget, and a tight one)? The
request bodies are measured as sent; *new bytes* are those past the previous
request's prefix (what a prefix cache cannot serve).

Usage: ``python bench/adapters.py [--conversations 10] [--turns 20] [--deltas 5 105]
[--long-turns 200] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, emit, fresh_db, quiet, table

sys.path.insert(0, str(ROOT / "tests"))

import anthropic
import httpx2
import openai
from replay import Recorded, ReplayServer, Reply, anthropic_stream, openai_stream

import torpor
from torpor.events import AssistantMessage, UserMessage
from torpor.llm.anthropic_messages import AnthropicModel
from torpor.llm.openai_chat import OpenAIChatModel
from torpor.llm.protocol import ContextMessage, SystemMessage, TextDelta

PROVIDERS = ("openai", "anthropic")
SYSTEM = "You are a terse assistant."


def user_text(conversation: int, turn: int) -> str:
    return f"conversation {conversation} turn {turn}: tell me something short."


def clients(url: str) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return (openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0),
            anthropic.AsyncAnthropic(base_url=url, api_key="bench", max_retries=0))


# -- question 1: overhead per turn and per delta -----------------------------------------


async def sdk_turn(provider: str, client: Any, model: str, history: list[dict[str, Any]]
                   ) -> str:
    """One turn by hand, the way code without torpor calls the SDK."""
    parts: list[str] = []
    if provider == "openai":
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, *history],
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
    else:
        stream = await client.messages.create(
            model=model, max_tokens=1024, system=SYSTEM, messages=history, stream=True)
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                parts.append(event.delta.text)
    return "".join(parts)


async def stats(url: str) -> list[float]:
    async with httpx2.AsyncClient() as http:
        response = await http.get(f"{url}/stats")
        seconds: list[float] = response.json()["server_seconds"]
        return seconds


class Client:
    """One way of taking turns (sdk, adapter or torpor) for one provider and answer size."""

    def __init__(self, url: str, provider: str, how: str, deltas: int, scratch: Path) -> None:
        self.provider, self.how, self.deltas = provider, how, deltas
        self.openai, self.anthropic = clients(url)
        self.client: Any = self.openai if provider == "openai" else self.anthropic
        self.name = f"replay-{deltas}"
        self.adapter: Any = (
            OpenAIChatModel(self.openai, model=self.name) if provider == "openai"
            else AnthropicModel(self.anthropic, model=self.name, max_tokens=1024))
        self.scratch = scratch
        self.rt: torpor.Runtime | None = None
        self.history: list[dict[str, Any]] = []
        self.context: list[ContextMessage] = []
        self.walls: list[float] = []
        self.server: list[float] = []
        self.cpu = 0.0

    async def __aenter__(self) -> Client:
        if self.how == "torpor":
            url = fresh_db(self.scratch, f"{self.provider}-{self.deltas}.db")
            agent = torpor.AgentConfig(model=self.adapter, system_prompt=SYSTEM,
                                       recall_tools=False)
            self.rt = await torpor.Runtime(url, agent=agent).__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.rt is not None:
            await self.rt.__aexit__(None, None, None)
        await self.openai.close()
        await self.anthropic.close()

    def new_conversation(self) -> None:
        self.history = []
        self.context = [SystemMessage(SYSTEM)]

    async def turn(self, conversation: str, ask: str) -> None:
        if self.rt is not None:
            turn = await self.rt.send(conversation, ask)
            async for _ in turn:
                pass
            await turn.result()
        elif self.how == "sdk":
            self.history.append({"role": "user", "content": ask})
            text = await sdk_turn(self.provider, self.client, self.name, self.history)
            self.history.append({"role": "assistant", "content": text})
        else:
            self.context.append(UserMessage(ask))
            parts = [e.text async for e in self.adapter.stream(self.context, ())
                     if isinstance(e, TextDelta)]
            self.context.append(AssistantMessage("".join(parts)))

    async def block(self, url: str, conversation: int, turns: int, *, timed: bool) -> None:
        """One conversation's turns, timed; then the server's own times for them."""
        self.new_conversation()
        name = f"c{conversation}" if timed else f"warm{conversation}"
        walls: list[float] = []
        cpu = time.process_time()
        for t in range(turns):
            started = time.perf_counter()
            await self.turn(name, user_text(conversation, t))
            walls.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        server = await stats(url)
        if len(server) != len(walls):
            raise RuntimeError(f"{len(walls)} turns, {len(server)} requests at the server")
        if timed:
            self.walls += walls
            self.server += server
            self.cpu += cpu

    def result(self) -> dict[str, Any]:
        over = [(w - s) * 1e6 for w, s in zip(self.walls, self.server, strict=True)]
        return {
            "provider": self.provider, "client": self.how, "deltas": self.deltas,
            "turns": len(self.walls),
            "overhead_us_mean": round(statistics.fmean(over), 1),
            "overhead_us_p50": round(statistics.median(over), 1),
            "server_us_mean": round(statistics.fmean(self.server) * 1e6, 1),
            "wall_us_mean": round(statistics.fmean(self.walls) * 1e6, 1),
            "client_cpu_us_per_turn": round(self.cpu / len(self.walls) * 1e6, 1),
        }


async def measure(url: str, provider: str, deltas: int, conversations: int, turns: int,
                  scratch: Path) -> list[dict[str, Any]]:
    """The three clients, interleaved conversation by conversation (drift hits all alike),
    after a warm-up conversation each."""
    hows = ("sdk", "adapter", "torpor")
    async with contextlib.AsyncExitStack() as stack:
        runners = [await stack.enter_async_context(Client(url, provider, how, deltas, scratch))
                   for how in hows]
        await stats(url)
        for runner in runners:
            await runner.block(url, 0, turns, timed=False)
        for c in range(conversations):
            for runner in runners:
                await runner.block(url, c, turns, timed=True)
        return [runner.result() for runner in runners]


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "replay.py")],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


# -- question 2: bytes re-sent per turn --------------------------------------------------


def bytes_reply(provider: str) -> Callable[[Recorded], Reply]:
    answer = ["Here is a short answer ", "with a few details: "]
    answer += [f"item {i}, " for i in range(40)]

    def reply(request: Recorded) -> Reply:
        if provider == "anthropic":
            return Reply(anthropic_stream(answer))
        return Reply(openai_stream(answer))

    return reply


async def resent_bytes(provider: str, label: str, agent_options: dict[str, Any], turns: int,
                       scratch: Path, db_name: str) -> dict[str, Any]:
    async with ReplayServer(default=bytes_reply(provider)) as server:
        openai_client, anthropic_client = clients(server.url)
        model: Any = (OpenAIChatModel(openai_client, model="m") if provider == "openai"
                      else AnthropicModel(anthropic_client, model="m", max_tokens=1024))
        agent = torpor.AgentConfig(model=model, system_prompt=SYSTEM, recall_tools=False,
                                   **agent_options)
        url = fresh_db(scratch, db_name)
        async with torpor.Runtime(url, agent=agent) as rt:
            for t in range(turns):
                ask = f"turn {t}: " + " ".join(f"fact-{t}-{k} is worth noting" for k in range(20))
                await (await rt.send("c", ask)).result()
            folds = len(await rt.store.checkpoints("c"))
        await openai_client.close()
        await anthropic_client.close()
        sizes = [len(r.body) for r in server.requests]
        fresh = []
        previous = b""
        for r in server.requests:
            body = r.body.replace(b',"cache_control":{"type":"ephemeral"}', b"")
            common = _common_prefix(previous, body)
            fresh.append(len(body) - common)
            previous = body
    return {
        "provider": provider, "policy": label, "turns": turns, "folds": folds,
        "bytes_per_turn_mean": round(statistics.fmean(sizes)),
        "bytes_per_turn_last": sizes[-1],
        "bytes_per_turn_max": max(sizes),
        "total_mb": round(sum(sizes) / 1e6, 2),
        "new_bytes_per_turn_mean": round(statistics.fmean(fresh)),
        "prefix_share": round(1 - sum(fresh) / sum(sizes), 3),
    }


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # the longest common prefix, by bisection on slices
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


POLICIES: dict[str, dict[str, Any]] = {
    "no folding": {"context_window": 1_000_000, "working_budget": 700_000},
    "default budget (32K)": {},
    "tight budget (8K)": {"working_budget": 8_000},
}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="torpor-bench-adapters-"))
    proc, url = start_server()
    rows: list[dict[str, Any]] = []
    try:
        for provider in PROVIDERS:
            for deltas in args.deltas:
                rows += await measure(url, provider, deltas, args.conversations, args.turns,
                                      scratch)
    finally:
        proc.terminate()
        proc.wait(10)
    per_delta: list[dict[str, Any]] = []
    few, many = min(args.deltas), max(args.deltas)
    for provider in PROVIDERS:
        for how in ("sdk", "adapter", "torpor"):
            a = next(r for r in rows if (r["provider"], r["client"], r["deltas"]) ==
                     (provider, how, few))
            b = next(r for r in rows if (r["provider"], r["client"], r["deltas"]) ==
                     (provider, how, many))
            slope = (b["overhead_us_mean"] - a["overhead_us_mean"]) / (many - few) if many > few \
                else None
            cpu = ((b["client_cpu_us_per_turn"] - a["client_cpu_us_per_turn"]) / (many - few)
                   if many > few else None)
            per_delta.append({"provider": provider, "client": how,
                              "us_per_delta": None if slope is None else round(slope, 2),
                              "cpu_us_per_delta": None if cpu is None else round(cpu, 2)})
    resent: list[dict[str, Any]] = []
    for provider in PROVIDERS:
        for n, (label, options) in enumerate(POLICIES.items()):
            resent.append(await resent_bytes(provider, label, options, args.long_turns, scratch,
                                             f"bytes-{provider}-{n}.db"))
    return {"overhead": rows, "per_delta": per_delta, "resent": resent}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=20, help="turns per conversation")
    p.add_argument("--deltas", type=int, nargs="+", default=[5, 105],
                   help="text deltas per answer (the slope between the smallest and the "
                        "largest is the cost per delta)")
    p.add_argument("--long-turns", type=int, default=200,
                   help="turns of the conversation whose re-sent bytes are measured")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    quiet()
    result = asyncio.run(main_async(args))
    few, many = min(args.deltas), max(args.deltas)
    overhead = table(
        f"overhead per turn beyond the server's time (µs; {args.conversations} conversations "
        f"x {args.turns} turns each)",
        ["provider", "client", "deltas", "mean", "p50", "client CPU/turn", "server time"],
        [[r["provider"], r["client"], r["deltas"], r["overhead_us_mean"], r["overhead_us_p50"],
          r["client_cpu_us_per_turn"], r["server_us_mean"]] for r in result["overhead"]],
    )
    extra: dict[tuple[str, str], dict[str, float]] = {}
    for r in result["overhead"]:
        if r["client"] != "sdk":
            base = next(s for s in result["overhead"] if s["client"] == "sdk" and
                        (s["provider"], s["deltas"]) == (r["provider"], r["deltas"]))
            extra[(r["provider"], f"{r['client']}@{r['deltas']}")] = {
                key: round(r[field] - base[field], 1) for key, field in (
                    ("mean_us", "overhead_us_mean"), ("p50_us", "overhead_us_p50"),
                    ("cpu_us", "client_cpu_us_per_turn"))}
    versus = table(
        "added to calling the SDK directly (µs per turn; the p50 and CPU columns are the "
        "steadier on a busy machine)",
        ["provider", "client @ deltas", "mean", "p50", "CPU"],
        [[p_, k, v["mean_us"], v["p50_us"], v["cpu_us"]] for (p_, k), v in extra.items()],
    )
    deltas = table(
        f"cost per streamed delta (slope between {few} and {many} deltas; µs)",
        ["provider", "client", "wall µs/delta", "CPU µs/delta"],
        [[r["provider"], r["client"], r["us_per_delta"], r["cpu_us_per_delta"]]
         for r in result["per_delta"]],
    )
    resent = table(
        f"bytes sent per turn over a {args.long_turns}-turn conversation",
        ["provider", "policy", "folds", "mean B/turn", "last B/turn", "total MB",
         "new B/turn", "prefix share"],
        [[r["provider"], r["policy"], r["folds"], r["bytes_per_turn_mean"],
          r["bytes_per_turn_last"], r["total_mb"], r["new_bytes_per_turn_mean"],
          r["prefix_share"]] for r in result["resent"]],
    )
    result["added_to_sdk_us"] = {f"{p_}/{k}": v for (p_, k), v in extra.items()}
    result["config"] = {"conversations": args.conversations, "turns": args.turns,
                        "deltas": args.deltas, "long_turns": args.long_turns,
                        "openai": openai.__version__, "anthropic": anthropic.__version__}
    emit({"benchmark": "adapters", **result}, [overhead, versus, deltas, resent], args.json)


if __name__ == "__main__":
    main()
