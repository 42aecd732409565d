"""End-to-end exact-match recall, 1-hop and 2-hop (design source 001, Table 1's shape).

Traces: ``TRACES`` conversations per flood level, each seeded early with
``NEEDLES`` needles (half 1-hop: ``cobalt-ledger.max_inflight = 7f3a9c21``; half
2-hop: ``cobalt-ledger.max_inflight: see ticket OPS-4821`` and, a few turns
later, ``Ticket OPS-4821 resolved: value 7f3a9c21``; one 1-hop needle in ten is
corrected later, and only the correction is right), then flooded with prose
until the conversation has folded 1, 3, 5 and 50 times. Then every needle is
asked for (``Q: What is the max_inflight of cobalt-ledger?``).

The agent is a deterministic torpor Model (:class:`RecallAgent`): it reads its
context, answers from it when the fact is there (in the tail, the recalled
section or a tool result), else formulates a query from the question (and, on a
retry, the task card) and calls ``recall``, ``expand``s hits whose snippets do
not show the whole fact, follows a ticket id for the second hop, and answers
with the value or ``unknown``. No query is written per needle.

Methods, all over the same turns:

* **truncation**: the last turns that fit the working budget, nothing else;
* **narrative**: at each fold a summary replaces the span; nothing is
  recallable. Modelled deterministically: the new summary keeps each fact line
  of the old one with p=0.7 and each fact line of the span with p=0.6, capped at
  ``SUMMARY_TOKENS`` (oldest dropped first), a stand-in for a lossy LLM summary;
* **pull**: torpor through the Runtime (SQLite), ``recall``/``expand`` tools;
* **push**: the same with ``AgentConfig.push_recall`` (task-conditioned push).

Scores: exact-match recall (answer == the latest value), false recalls (a value
that is not the right one: a stale or foreign value), pull frequency (questions
whose turn called a tool), and the recalled section's size on every call.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from needles import FLOOD_WORDS

from torpor import AgentConfig, Runtime, RuntimeConfig
from torpor.compaction import make_token_counter
from torpor.compaction.push import query_words
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage, TextDelta, ToolCallDelta, ToolSpec

TRACES = 10
NEEDLES = 50
LEVELS = (1, 3, 5, 50)
WORKING_BUDGET = 5_000
TAIL_TURNS = 3
FLOOD_TOKENS = 400
SUMMARY_TOKENS = 600
PUSH_TOKENS = 2_000

ADJECTIVES = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "granite", "harbor",
              "indigo", "juniper", "krypton", "lagoon")
NOUNS = ("ledger", "gateway", "mailer", "ingest", "search", "billing", "auth", "report",
         "queue", "vault", "relay", "cache")
ATTRS = ("max_inflight", "pool_size", "cache_ttl_s", "deploy_key", "shard_count")
CARD_GOAL = "Answer questions about service settings recorded in notes and tickets"
SYSTEM = "Answer from this conversation's history; use recall and expand for folded parts."


@dataclass(frozen=True)
class Needle:
    subject: str
    attr: str
    value: str  # the right answer (after any correction)
    hops: int
    ticket: str = ""
    stale: str = ""  # the value a later correction replaced ("" when none)

    @property
    def question(self) -> str:
        return f"Q: What is the {self.attr} of {self.subject}?"


@dataclass
class Trace:
    seed: int
    needles: list[Needle]
    seeding: list[str]  # user messages, one a turn


def _value(seed: int, i: int, salt: str = "") -> str:
    return hashlib.sha1(f"{seed}-{i}-{salt}".encode()).hexdigest()[:8]


def make_trace(seed: int, needles: int) -> Trace:
    rng = random.Random(seed)
    subjects = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], needles)
    tickets = rng.sample(range(1000, 10_000), needles)
    made: list[Needle] = []
    seeding: list[str] = []
    later: list[tuple[int, str]] = []  # (index in seeding to put it at, message)
    corrections: list[str] = []
    for i, subject in enumerate(subjects):
        attr = ATTRS[rng.randrange(len(ATTRS))]
        value = _value(seed, i)
        pad = " ".join(rng.choice(FLOOD_WORDS) for _ in range(12))
        if i % 2:
            ticket = f"OPS-{tickets[i]}"
            seeding.append(f"{pad}. {subject}.{attr}: see ticket {ticket}.")
            later.append((len(seeding) + 4, f"{pad}. Ticket {ticket} resolved: value {value}."))
            made.append(Needle(subject, attr, value, 2, ticket=ticket))
        elif i % 10 == 0:
            new = _value(seed, i, "corrected")
            seeding.append(f"{pad}. For the record: {subject}.{attr} = {value}.")
            corrections.append(f"Correction: {subject}.{attr} = {new}.")
            made.append(Needle(subject, attr, new, 1, stale=value))
        else:
            seeding.append(f"{pad}. For the record: {subject}.{attr} = {value}.")
            made.append(Needle(subject, attr, value, 1))
    for index, message in sorted(later, reverse=True):
        seeding.insert(min(index, len(seeding)), message)
    seeding.extend(corrections)
    return Trace(seed, made, seeding)


def flood(rng: random.Random) -> str:
    return " ".join(rng.choice(FLOOD_WORDS) for _ in range(FLOOD_TOKENS))


# --- the deterministic agent ------------------------------------------------------------

_EVENT_LINE = re.compile(r"^(?:- event (\d+) \(|--- event (\d+) \(|#(\d+) )")
_NAMED = re.compile(r"(?:- event (\d+) \(|--- event (\d+) \(|#(\d+) )")
_TICKET = re.compile(r"\bOPS-\d+\b")
_LATE = 10**9  # tail messages: newer than anything folded


def _evidence(messages: Sequence[ContextMessage], start: int) -> list[tuple[int, str]]:
    """(position, text) of everything the agent can read: tail messages (newer than any
    folded event, in order), system blocks and tool results line by line, a line that
    names an event taking its position (recall hits, expand output, the recalled section)."""
    found: list[tuple[int, str]] = []
    for index, message in enumerate(messages):
        if isinstance(message, SystemMessage | ToolResult):
            text = message.text if isinstance(message, SystemMessage) else message.content
            position = 0
            for line in text.splitlines():
                # A line may quote an older tool result that quotes other events in turn
                # (a recall hit on an earlier recall's output): each piece of text belongs
                # to the event named last before it.
                cut = 0
                for match in _NAMED.finditer(line):
                    if match.start() > cut:
                        found.append((position, line[cut:match.start()]))
                    position = int(next(g for g in match.groups() if g))
                    cut = match.start()
                found.append((position, line[cut:]))
        elif isinstance(message, UserMessage) and index < start:
            found.append((_LATE + index, message.text))
    return found


def _answer(needle_key: tuple[str, str], evidence: list[tuple[int, str]]) -> tuple[str, str]:
    """(value or "", ticket or "") that the evidence shows for (subject, attr)."""
    subject, attr = (re.escape(part) for part in needle_key)
    direct = re.compile(rf"{subject}\.{attr} = ([0-9a-f]{{8}})\b")
    pointer = re.compile(rf"{subject}\.{attr}: see ticket (OPS-\d+)")
    best: tuple[int, str] | None = None
    ticket = ""
    for position, text in evidence:
        for match in direct.finditer(text):
            if best is None or position >= best[0]:
                best = (position, match.group(1))
        match = pointer.search(text)
        if match:
            ticket = match.group(1)
    if best is not None:
        return best[1], ticket
    if ticket:
        resolved = re.compile(rf"Ticket {re.escape(ticket)} resolved: value ([0-9a-f]{{8}})\b")
        for _, text in evidence:
            match = resolved.search(text)
            if match:
                return match.group(1), ticket
    return "", ticket


class RecallAgent:
    """A deterministic stand-in for an LLM agent (see the module doc)."""

    name = "recall-agent"

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[TextDelta | ToolCallDelta]:
        for item in decide(context, {t.name for t in tools}):
            yield item


def decide(
    context: Sequence[ContextMessage], tools: set[str]
) -> list[TextDelta | ToolCallDelta]:
    start = max(i for i, m in enumerate(context) if isinstance(m, UserMessage))
    question = context[start]
    assert isinstance(question, UserMessage)
    if not question.text.startswith("Q: "):
        return [TextDelta("noted.")]
    words = query_words(question.text)
    subject = next((w for w in words if "-" in w), "")
    attr = next((w for w in words if "_" in w), "")
    value, ticket = _answer((subject, attr), _evidence(context, start))
    if value:
        return [TextDelta(f"ANSWER: {value}")]
    if "recall" not in tools:
        return [TextDelta("ANSWER: unknown")]
    queries: list[str] = []
    expanded: set[int] = set()
    hits: list[tuple[int, str]] = []
    for message in context[start + 1:]:
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls:
                if call.name == "recall":
                    queries.append(str(call.arguments.get("query", "")))
                elif call.name == "expand":
                    expanded.add(int(call.arguments.get("start", -1)))
        elif isinstance(message, ToolResult) and message.tool == "recall":
            for line in message.content.splitlines():
                match = _EVENT_LINE.match(line)
                if match:
                    hits.append((int(next(g for g in match.groups() if g)), line))
    call_id = f"call_{len(context)}"
    card = next((m.text for m in context if isinstance(m, SystemMessage)
                 and m.text.startswith("Task card")), "")
    wanted = [q for q in (
        ticket,  # the second hop: follow the identifier
        " ".join(words),  # the question's own salient words
        " ".join(query_words(question.text + " " + card)),  # reformulated with the card
    ) if q]
    for query in wanted:
        if query in queries:
            # asked already: read in full the hits that name what we look for
            key = ticket if query == ticket else subject
            for position, line in hits:
                if key and key in line and position not in expanded:
                    return [ToolCallDelta(ToolCall(call_id, "expand", {"start": position}))]
            continue
        return [ToolCallDelta(ToolCall(call_id, "recall", {"query": query, "k": 10}))]
    return [TextDelta("ANSWER: unknown")]


# --- running the methods ----------------------------------------------------------------


@dataclass
class Score:
    hops: dict[int, list[int]] = field(default_factory=lambda: {1: [0, 0], 2: [0, 0]})
    false: int = 0
    asked: int = 0
    pulled: int = 0

    def add(self, needle: Needle, answer: str, pulled: bool = False) -> None:
        self.asked += 1
        self.pulled += pulled
        right = answer == needle.value
        self.hops[needle.hops][0] += right
        self.hops[needle.hops][1] += 1
        if answer not in ("", "unknown") and not right:
            self.false += 1


def _parse(text: str) -> str:
    return text.removeprefix("ANSWER: ").strip() if text.startswith("ANSWER: ") else ""


def _fits(texts: list[str], budget: int, count: Any) -> list[str]:
    kept: list[str] = []
    total = 0
    for text in reversed(texts):
        total += count(UserMessage(text))
        if total > budget:
            break
        kept.append(text)
    return kept[::-1]


_FACT = re.compile(r"[\w-]+\.\w+ = [0-9a-f]{8}|[\w-]+\.\w+: see ticket OPS-\d+|"
                   r"Ticket OPS-\d+ resolved: value [0-9a-f]{8}")


def simulate(trace: Trace, floods: list[str], count: Any) -> dict[str, Score]:
    """Truncation and narrative compaction over the same turns (no runtime: nothing for
    them to recall), folding when the tail passes the working budget, like torpor."""
    rng = random.Random(trace.seed * 7 + len(floods))
    turns = trace.seeding + floods
    tail: list[str] = []
    summary: list[str] = []
    for text in turns:
        tail.append(text)
        tokens = sum(count(UserMessage(t)) + count(AssistantMessage("noted.")) for t in tail)
        if tokens > WORKING_BUDGET:
            folded, tail = tail[:-TAIL_TURNS], tail[-TAIL_TURNS:]
            kept = [line for line in summary if rng.random() < 0.7]
            for text_ in folded:
                kept.extend(m.group() for m in _FACT.finditer(text_) if rng.random() < 0.6)
            while kept and sum(count(UserMessage(x)) for x in kept) > SUMMARY_TOKENS:
                kept.pop(0)
            summary = kept
    window = _fits(turns, WORKING_BUDGET, count)
    scores = {"truncation": Score(), "narrative": Score()}
    for needle in trace.needles:
        for method, context in (
            ("truncation", [UserMessage(t) for t in window]),
            ("narrative", [SystemMessage("\n".join(summary)), *[UserMessage(t) for t in tail]]),
        ):
            asked = [SystemMessage(SYSTEM), *context, UserMessage(needle.question)]
            reply = decide(asked, set())[0]
            assert isinstance(reply, TextDelta)
            scores[method].add(needle, _parse(reply.text))
    return scores


def agent_config(push: bool) -> AgentConfig:
    return AgentConfig(
        system_prompt=SYSTEM,
        context_window=16_000,
        max_output_tokens=1_000,
        safety_margin=200,
        working_budget=WORKING_BUDGET,
        tail_turns=TAIL_TURNS,
        recall_tools=True,
        push_recall=push,
        push_tokens=PUSH_TOKENS,
        max_steps=8,
    )


async def run_conversation(
    rt: Runtime, name: str, trace: Trace, cycles: int, floods: list[str] | None
) -> tuple[Score, list[str], dict[str, Any]]:
    """Seed, flood to ``cycles`` folds (or with the given floods), ask every needle."""
    await rt.task(name).update(goal=CARD_GOAL, constraints=["answer with the exact value"])
    for text in trace.seeding:
        await (await rt.send(name, text)).result()
    rng = random.Random(trace.seed * 1_000 + cycles)
    sent: list[str] = []
    if floods is None:
        while True:
            checkpoint = await rt.store.latest_checkpoint(name)
            if checkpoint is not None and checkpoint.cycle >= cycles:
                break
            sent.append(flood(rng))
            await (await rt.send(name, sent[-1])).result()
    else:
        for text in floods:
            sent.append(text)
            await (await rt.send(name, text)).result()
    checkpoint = await rt.store.latest_checkpoint(name)
    reached = checkpoint.cycle if checkpoint is not None else 0
    score = Score()
    order = list(trace.needles)
    random.Random(trace.seed).shuffle(order)
    for needle in order:
        turn = await rt.send(name, needle.question)
        final = await turn.result()
        assert isinstance(final, AssistantMessage)
        calls = await rt.store.model_calls(name, turn=turn.number, limit=100)
        score.add(needle, _parse(final.text), pulled=len(calls) > 1)
    calls = await rt.store.model_calls(name, limit=1_000_000)
    recalled = [c.sections.get("recalled", 0) for c in calls]
    pushed = [c for c in calls if c.pushed]
    info = {
        "cycles_before_questions": reached,
        "cycles_at_end": calls[-1].compaction_cycle if calls else 0,
        "flood_turns": len(sent),
        "calls": len(calls),
        "calls_with_push": len(pushed),
        "recalled_max_tokens": max(recalled, default=0),
        "recalled_within_budget": all(r <= PUSH_TOKENS for r in recalled),
    }
    return score, sent, info


def _summary(scores: list[Score]) -> dict[str, Any]:
    def rates(hops: int | None) -> list[float]:
        out = []
        for s in scores:
            right = sum(v[0] for h, v in s.hops.items() if hops in (None, h))
            total = sum(v[1] for h, v in s.hops.items() if hops in (None, h))
            out.append(100.0 * right / total if total else 0.0)
        return out

    def stat(values: list[float]) -> dict[str, float]:
        return {"mean": round(statistics.fmean(values), 1),
                "sd": round(statistics.pstdev(values), 1) if len(values) > 1 else 0.0}

    asked = sum(s.asked for s in scores)
    return {
        "all": stat(rates(None)),
        "1-hop": stat(rates(1)),
        "2-hop": stat(rates(2)),
        "false_recall_pct": round(100.0 * sum(s.false for s in scores) / asked, 2),
        "pull_pct": round(100.0 * sum(s.pulled for s in scores) / asked, 1),
        "asked": asked,
    }


async def run(*, traces: int = TRACES, needles: int = NEEDLES,
              levels: Sequence[int] = LEVELS) -> dict[str, Any]:
    count = make_token_counter()
    made = [make_trace(seed, needles) for seed in range(1, traces + 1)]
    results: dict[str, Any] = {}
    config = RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    with tempfile.TemporaryDirectory(prefix="torpor-table1-") as tmp:
        runtimes = {
            method: Runtime(f"sqlite:///{tmp}/{method}.db", model=RecallAgent(),
                            agent=agent_config(method == "push"), config=config)
            for method in ("pull", "push")
        }
        async with runtimes["pull"] as pull_rt, runtimes["push"] as push_rt:
            for cycles in levels:
                pulled = await asyncio.gather(*(
                    run_conversation(pull_rt, f"t{t.seed}-c{cycles}", t, cycles, None)
                    for t in made
                ))
                pushed = await asyncio.gather(*(
                    run_conversation(push_rt, f"t{t.seed}-c{cycles}", t, cycles, sent)
                    for t, (_, sent, _) in zip(made, pulled, strict=True)
                ))
                sims = [simulate(t, sent, count)
                        for t, (_, sent, _) in zip(made, pulled, strict=True)]
                print(f"level {cycles}: done", file=sys.stderr, flush=True)
                results[str(cycles)] = {
                    "truncation": _summary([s["truncation"] for s in sims]),
                    "narrative": _summary([s["narrative"] for s in sims]),
                    "pull": {**_summary([s for s, _, _ in pulled]),
                             "runs": [info for _, _, info in pulled]},
                    "push": {**_summary([s for s, _, _ in pushed]),
                             "runs": [info for _, _, info in pushed]},
                }
    return {
        "benchmark": "needles-table1",
        "traces": traces,
        "needles_per_trace": needles,
        "levels": list(levels),
        "working_budget": WORKING_BUDGET,
        "tail_turns": TAIL_TURNS,
        "push_tokens": PUSH_TOKENS,
        "results": results,
        "targets": targets(results),
    }


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked on the figures (torpor: the better of pull and push)."""
    out: dict[str, Any] = {}
    for level, want in (("5", 98.0), ("50", 95.0)):
        if level in results:
            row = results[level]
            got = max(row["pull"]["2-hop"]["mean"], row["push"]["2-hop"]["mean"])
            out[f"2hop_after_{level}_ge_{want:g}"] = {"value": got, "met": got >= want}
    false = max((r[m]["false_recall_pct"] for r in results.values() for m in ("pull", "push")),
                default=0.0)
    out["false_recalls_le_2pct"] = {"value": false, "met": false <= 2.0}
    within = all(run["recalled_within_budget"] for r in results.values()
                 for run in r["push"]["runs"])
    out["pushed_within_budget_every_call"] = {"value": within, "met": within}
    return out


def table(report: dict[str, Any]) -> str:
    lines = [
        f"Table 1 shape: exact-match recall % (mean ± sd over {report['traces']} traces, "
        f"{report['needles_per_trace']} needles each, half 2-hop)",
        f"{'method':<30}" + "".join(f"{'after ' + lv + ' cyc':>18}"
                                    for lv in map(str, report['levels'])),
    ]
    names = (("truncation", "Truncation"), ("narrative", "Narrative compaction"),
             ("pull", "torpor pull-only"), ("push", "torpor push+pull"))
    for hops in ("1-hop", "2-hop"):
        for key, label in names:
            cells = []
            for level in map(str, report["levels"]):
                s = report["results"][level][key][hops]
                cells.append(f"{s['mean']:>11.1f} ±{s['sd']:>4.1f}")
            lines.append(f"{label + ' ' + hops:<30}" + "".join(f"{c:>18}" for c in cells))
    lines.append("")
    lines.append(f"{'false recalls % / pull %':<28}" + "".join(
        f"{lv + ' cyc':>22}" for lv in map(str, report["levels"])))
    for key, label in names:
        lines.append(f"{label:<28}" + "".join(
            f"{report['results'][lv][key]['false_recall_pct']:>12.1f} / "
            f"{report['results'][lv][key]['pull_pct']:>5.1f}"
            for lv in map(str, report["levels"])))
    for name, target in report["targets"].items():
        lines.append(f"target {name}: {target['value']} -> {'met' if target['met'] else 'MISSED'}")
    return "\n".join(lines)
