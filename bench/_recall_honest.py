"""Table 1 with needles written as people write them (issue 25: "make Table 1 honest").

Today's generator (:mod:`_recall_table1`) avoids by construction what issue 25 found
missing: its needles are identifiers repeated verbatim in the questions, its flood is
about 30 unrelated words, its corrections are ``x.y = v`` and its 2-hop facts use the
``see ticket OPS-…`` form push looks for. This one keeps the same runtime, agent loop,
folds and scores, and changes what is said and asked:

* **prose** (1-hop): "The billing cutover is owned by Marisol Quan." asked as "Who owns
  the billing cutover?", in a flood of prose about the same systems and activities (the
  words of every question are common in the conversation), with near-miss distractors
  ("The billing cutover checklist is owned by the platform team.");
* **correction** (1-hop): "The payments service is going to ap-northeast-1." then, the
  next turn, "Scratch that, use eu-north-1." (half name the service again, half do not);
  asked as "Where are we deploying payments?"; only the correction is right, the old
  value is a false recall;
* **number** (1-hop): "The 20,000-user load test of search ran on host kestrel-17."
  (``20,000`` or ``20 000``) asked as "Which host ran the 20000-user load test?", among
  other load tests of other sizes (only the number tells them apart);
* **accent** (1-hop): "Søren Ødegård's badge number is K-4417." asked as "What is Soren
  Odegard's badge number?", among other people's badges (only the name tells them apart);
* **prose 2-hop**: "The ledger incident is tracked in OPS-4821." and later "OPS-4821 was
  closed by rotating key 7f3a9c21.", asked as "Which key closed the ledger incident?".

The agent forms its recall queries from the question's own words
(:func:`torpor.compaction.push.query_words`, then with the task card's), never from the
stored phrasing; it reads a fact when one is in front of it (as an LLM would: each
needle carries the patterns that recognise its fact), ``expand``s the best hits whose
snippets do not show it, follows a ticket id for the second hop, and answers the newest
value it saw (a correction that names no subject counts when it is the turn right after
the fact it corrects, as a reader would take it).
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from _recall_table1 import (
    _EVENT_LINE,
    CARD_GOAL,
    LEVELS,
    Score,
    _evidence,
    _parse,
    _summary,
    agent_config,
)

from torpor import Runtime, RuntimeConfig
from torpor.compaction.push import query_words
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage, TextDelta, ToolCallDelta, ToolSpec

TRACES = 6
NEEDLES = 40
FLOOD_SENTENCES = 22  # about 400 tokens a flood turn
MAX_EXPANDS = 2  # per recall: the best hits
MAX_CALLS = 7  # tool calls a turn makes at most (agent_config's max_steps is 8)

SYSTEMS = ("billing", "payments", "search", "ledger", "gateway", "ingest", "mailer",
           "reports", "auth", "checkout", "catalog", "pricing")
ACTIVITIES = ("cutover", "migration", "rollout", "audit", "freeze")
FIRST = ("Marisol", "Devon", "Priya", "Tomas", "Aiko", "Nnamdi", "Greta", "Rafael",
         "Ines", "Kwame", "Lena", "Omar", "Yusuf", "Hana", "Bruno", "Clara")
LAST = ("Quan", "Okafor", "Lindqvist", "Haddad", "Moreau", "Tanaka", "Brennan", "Varga",
        "Castillo", "Novak", "Achebe", "Iversen", "Rossi", "Sato", "Kowal", "Duarte")
REGIONS = ("ap-northeast-1", "eu-north-1", "us-east-2", "eu-west-3", "ap-south-1",
           "sa-east-1", "ca-central-1", "us-west-1", "me-south-1", "af-south-1")
HOSTS = ("kestrel", "osprey", "heron", "plover", "condor", "merlin", "petrel", "falcon")
ACCENTED = ("Søren Ødegård", "Łukasz Żółć", "Zoë Ångström", "José Muñoz", "Björn Þórsson",
            "François Légère", "Małgorzata Wróbel", "Øystein Ærø", "Jiří Dvořák",
            "Çağla Şahin", "Ana Lúcia Araújo", "Noémie Brûlé")
FOLD = str.maketrans({"ø": "o", "Ø": "O", "ł": "l", "Ł": "L", "ß": "ss", "æ": "ae",
                      "Æ": "Ae", "þ": "th", "Þ": "Th"})
COMMON = ("the", "team", "said", "the", "dashboards", "were", "slow", "again", "after",
          "we", "checked", "service", "deploy", "load", "test", "users", "owner", "ticket",
          "incident", "host", "region", "badge", "number", "key", "rotated", "review",
          "checklist", "next", "week", "plan", "notes", "meeting", "window")


def _ascii(name: str) -> str:
    import unicodedata

    decomposed = unicodedata.normalize("NFD", name.translate(FOLD))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


@dataclass(frozen=True)
class Needle:
    kind: str
    question: str
    value: str
    hops: int
    fact: str  # a pattern whose group 1 is the value (or, 2-hop, the ticket)
    fix: str = ""  # a correction's pattern (group 1: the new value)
    resolve: str = ""  # 2-hop: the second fact's pattern, "{ticket}" in it
    stale: str = ""


@dataclass
class Trace:
    seed: int
    needles: list[Needle]
    seeding: list[str]
    registry: dict[str, Needle] = field(default_factory=dict)


def _pad(rng: random.Random, n: int = 10) -> str:
    return " ".join(rng.choice(COMMON) for _ in range(n)).capitalize()


def make_trace(seed: int, needles: int) -> Trace:
    rng = random.Random(seed * 31 + 5)
    subjects = rng.sample([(s, a) for s in SYSTEMS for a in ACTIVITIES], needles)
    people = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], needles)
    tickets = rng.sample(range(1000, 10_000), needles)
    accented = list(ACCENTED)
    rng.shuffle(accented)
    seeding: list[str] = []
    later: list[tuple[int, str]] = []
    made: list[Needle] = []
    services = list(SYSTEMS)
    rng.shuffle(services)
    for i, (system, activity) in enumerate(subjects):
        kind = ("prose", "correction", "number", "accent", "2hop")[i % 5]
        pad = _pad(rng)
        if kind == "prose" or (kind == "accent" and not accented) or (
            kind == "correction" and not services
        ):
            person = people[i]
            seeding.append(f"{pad}. The {system} {activity} is owned by {person}.")
            made.append(Needle("prose", f"Q: Who owns the {system} {activity}?", person, 1,
                               rf"The {system} {activity} is owned by ([A-Z]\w+ [A-Z]\w+)"))
        elif kind == "correction":
            service = services.pop()
            old, new = rng.sample(REGIONS, 2)
            seeding.append(f"{pad}. The {service} service is going to {old}.")
            fix = (f"Scratch that, use {new}." if i % 2 else
                   f"Scratch that, {service} goes to {new} instead.")
            seeding.append(fix)
            made.append(Needle(
                "correction", f"Q: Where are we deploying {service}?", new, 1,
                rf"The {service} service is going to ([a-z]+-[a-z]+-\d)",
                fix=rf"Scratch that, (?:use|{service} goes to) ([a-z]+-[a-z]+-\d)", stale=old,
            ))
        elif kind == "number":
            users = rng.randrange(2, 99) * 1000
            written = f"{users:,}" if i % 2 else f"{users:,}".replace(",", " ")
            host = f"{rng.choice(HOSTS)}-{rng.randrange(10, 99)}"
            seeding.append(f"{pad}. The {written}-user load test of {system} ran on host "
                           f"{host}.")
            grouped = f"{users:,}".replace(",", "[, ]")  # either spelling, as a reader reads
            made.append(Needle(
                "number", f"Q: Which host ran the {users}-user load test of {system}?", host, 1,
                rf"The {grouped}-user load test of {system} ran on host ([a-z]+-\d+)",
            ))
        elif kind == "accent":
            name = accented.pop()
            badge = f"K-{rng.randrange(1000, 9999)}"
            seeding.append(f"{pad}. {name}'s badge number is {badge}.")
            made.append(Needle("accent", f"Q: What is {_ascii(name)}'s badge number?", badge,
                               1, rf"{re.escape(name)}'s badge number is (K-\d+)"))
        else:
            ticket = f"OPS-{tickets[i]}"
            key = f"{rng.getrandbits(32):08x}"
            seeding.append(f"{pad}. The {system} {activity} incident is tracked in {ticket}.")
            later.append((len(seeding) + 4, f"{_pad(rng)}. {ticket} was closed by rotating "
                          f"key {key}."))
            made.append(Needle(
                "2hop", f"Q: Which key closed the {system} {activity} incident?", key, 2,
                rf"The {system} {activity} incident is tracked in (OPS-\d+)",
                resolve=r"{ticket} was closed by rotating key ([0-9a-f]{8})",
            ))
    for index, message in sorted(later, reverse=True):
        seeding.insert(min(index, len(seeding)), message)
    trace = Trace(seed, made, seeding)
    trace.registry = {n.question: n for n in made}
    return trace


def flood(rng: random.Random) -> str:
    """Prose about the same systems and activities as the needles (their words common
    here), with near-miss facts: other load tests (the number is what tells them apart)
    and other people's badges (the name is)."""
    out: list[str] = []
    for _ in range(FLOOD_SENTENCES):
        system, activity = rng.choice(SYSTEMS), rng.choice(ACTIVITIES)
        shape = rng.randrange(8)
        if shape == 6:  # a load test like the needles', another size (never one of theirs)
            users = rng.randrange(2, 99) * 1000 + 500
            out.append(f"The {users:,}-user load test of {system} ran on host "
                       f"{rng.choice(HOSTS)}-{rng.randrange(10, 99)}.")
        elif shape == 7:  # someone else's badge
            out.append(f"{rng.choice(FIRST)} {rng.choice(LAST)}'s badge number is "
                       f"K-{rng.randrange(1000, 9999)}.")
        elif shape == 0:
            out.append(f"The {system} {activity} checklist is owned by the platform team.")
        elif shape == 1:
            out.append(f"The {system} dashboards were slow during the {activity} again.")
        elif shape == 2:
            out.append(f"We talked about the {system} {activity} and the load test users.")
        elif shape == 3:
            out.append(f"Someone asked about the {system} {activity} review next week.")
        elif shape == 4:
            out.append(f"The {system} service deploy went to the usual region after review.")
        else:
            out.append(_pad(rng, 12) + ".")
    return " ".join(out)


# --- the agent --------------------------------------------------------------------------


def _read(needle: Needle, evidence: list[tuple[int, str]]) -> tuple[str, str]:
    """(value or "", ticket or "") the evidence shows for ``needle``; the newest wins."""
    best: tuple[int, str] | None = None
    fact = re.compile(needle.fact)
    facts: list[int] = []
    ticket = ""
    for position, text in evidence:
        for match in fact.finditer(text):
            if needle.hops == 2:
                ticket = match.group(1)
                continue
            facts.append(position)
            if best is None or position >= best[0]:
                best = (position, match.group(1))
    if needle.fix:
        fix = re.compile(needle.fix)
        for position, text in evidence:
            for match in fix.finditer(text):
                # an unnamed correction counts right after the fact it corrects
                applies = "goes to" in match.group(0) or any(0 < position - p <= 2 for p in facts)
                if applies and (best is None or position >= best[0]):
                    best = (position, match.group(1))
    if best is not None:
        return best[1], ticket
    if ticket:
        resolve = re.compile(needle.resolve.replace("{ticket}", re.escape(ticket)))
        for _, text in evidence:
            match = resolve.search(text)
            if match:
                return match.group(1), ticket
    return "", ticket


class HonestAgent:
    """The deterministic reader of this module (see its doc)."""

    name = "honest-agent"

    def __init__(self, registry: dict[str, Needle]) -> None:
        self.registry = registry

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[TextDelta | ToolCallDelta]:
        for item in self.decide(context, {t.name for t in tools}):
            yield item

    def decide(
        self, context: Sequence[ContextMessage], tools: set[str]
    ) -> list[TextDelta | ToolCallDelta]:
        start = max(i for i, m in enumerate(context) if isinstance(m, UserMessage))
        question = context[start]
        assert isinstance(question, UserMessage)
        needle = self.registry.get(question.text)
        if needle is None:
            return [TextDelta("noted.")]
        evidence = _evidence(context, start)
        # An unnamed correction in the tail sits right after its fact, in log order.
        value, ticket = _read(needle, evidence)
        if value:
            return [TextDelta(f"ANSWER: {value}")]
        if "recall" not in tools:
            return [TextDelta("ANSWER: unknown")]
        queries: list[str] = []
        expanded: set[int] = set()
        hits: list[int] = []
        for message in context[start + 1:]:
            if isinstance(message, AssistantMessage):
                for call in message.tool_calls:
                    if call.name == "recall":
                        queries.append(str(call.arguments.get("query", "")))
                    elif call.name == "expand":
                        expanded.add(int(call.arguments.get("start", -1)))
            elif isinstance(message, ToolResult) and message.tool == "recall":
                hits = []  # the newest recall's hits, best first
                for line in message.content.splitlines():
                    match = _EVENT_LINE.match(line)
                    if match:
                        hits.append(int(next(g for g in match.groups() if g)))
        if len(queries) + len(expanded) >= MAX_CALLS:
            return [TextDelta("ANSWER: unknown")]
        call_id = f"call_{len(context)}"
        card = next((m.text for m in context if isinstance(m, SystemMessage)
                     and m.text.startswith("Task card")), "")
        words = query_words(question.text)
        wanted = [q for q in (
            ticket,
            " ".join(words),
            " ".join(query_words(question.text + " " + card)),
        ) if q]
        for query in wanted:
            if query in queries:
                if query == queries[-1]:
                    for position in hits[:MAX_EXPANDS]:
                        if position not in expanded:
                            return [ToolCallDelta(ToolCall(call_id, "expand",
                                                           {"start": position}))]
                continue
            return [ToolCallDelta(ToolCall(call_id, "recall", {"query": query, "k": 10}))]
        return [TextDelta("ANSWER: unknown")]


# --- running ----------------------------------------------------------------------------


class _Agents:
    """One model for every trace: the registry is the union of theirs."""

    def __init__(self, traces: Sequence[Trace]) -> None:
        registry: dict[str, Needle] = {}
        for trace in traces:
            registry.update(trace.registry)
        self.agent = HonestAgent(registry)


async def _conversation(
    rt: Runtime, name: str, trace: Trace, cycles: int, floods: list[str] | None
) -> tuple[dict[str, Score], list[str]]:
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
    scores: dict[str, Score] = {}
    order = list(trace.needles)
    random.Random(trace.seed).shuffle(order)
    for needle in order:
        turn = await rt.send(name, needle.question)
        final = await turn.result()
        assert isinstance(final, AssistantMessage)
        calls = await rt.store.model_calls(name, turn=turn.number, limit=100)
        answer = _parse(final.text)
        for key in ("all", needle.kind):
            scores.setdefault(key, Score()).add(needle, answer, pulled=len(calls) > 1)
        if answer != needle.value:
            stale = f", stale {needle.stale!r}" if needle.stale else ""
            print(f"miss {name} {needle.kind}: {needle.question!r} -> {answer!r} "
                  f"(want {needle.value!r}{stale})", file=sys.stderr)
    return scores, sent


async def run(*, traces: int = TRACES, needles: int = NEEDLES,
              levels: Sequence[int] = LEVELS) -> dict[str, Any]:
    made = [make_trace(seed, needles) for seed in range(1, traces + 1)]
    agents = _Agents(made)
    results: dict[str, Any] = {}
    config = RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    with tempfile.TemporaryDirectory(prefix="torpor-honest-") as tmp:
        pull_rt = Runtime(f"sqlite:///{tmp}/pull.db", model=agents.agent,
                          agent=agent_config(False), config=config)
        push_rt = Runtime(f"sqlite:///{tmp}/push.db", model=agents.agent,
                          agent=agent_config(True), config=config)
        async with pull_rt, push_rt:
            for cycles in levels:
                pulled = await asyncio.gather(*(
                    _conversation(pull_rt, f"h{t.seed}-c{cycles}", t, cycles, None)
                    for t in made
                ))
                pushed = await asyncio.gather(*(
                    _conversation(push_rt, f"h{t.seed}-c{cycles}", t, cycles, sent)
                    for t, (_, sent) in zip(made, pulled, strict=True)
                ))
                print(f"honest level {cycles}: done", file=sys.stderr, flush=True)
                row: dict[str, Any] = {}
                for method, runs in (("pull", pulled), ("push", pushed)):
                    kinds = sorted({k for s, _ in runs for k in s})
                    row[method] = {
                        kind: _summary([s[kind] for s, _ in runs if kind in s]) for kind in kinds
                    }
                results[str(cycles)] = row
    return {"benchmark": "needles-table1-honest", "traces": traces,
            "needles_per_trace": needles, "levels": list(levels), "results": results,
            "targets": targets(results)}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 25's: pull 1-hop and 2-hop >= 99% at 1 and 50 folds, false recall <= 0.5%."""
    out: dict[str, Any] = {}
    for level in ("1", "50"):
        if level not in results:
            continue
        pull = results[level]["pull"]["all"]
        for hops in ("1-hop", "2-hop"):
            got = pull[hops]["mean"]
            out[f"pull_{hops}_after_{level}_ge_99"] = {"value": got, "met": got >= 99.0}
    false = max((r[m]["all"]["false_recall_pct"] for r in results.values()
                 for m in ("pull", "push")), default=0.0)
    out["false_recall_le_0.5pct"] = {"value": false, "met": false <= 0.5}
    return out


def table(report: dict[str, Any]) -> str:
    levels = [str(level) for level in report["levels"]]
    lines = [
        f"Table 1, honest generator: exact match % ({report['traces']} traces, "
        f"{report['needles_per_trace']} needles each; prose, correction, number, accent, "
        "prose 2-hop)",
        f"{'':<34}" + "".join(f"{'after ' + lv + ' cyc':>14}" for lv in levels),
    ]
    for method in ("pull", "push"):
        for label, kind, hops in (("1-hop", "all", "1-hop"), ("2-hop", "all", "2-hop"),
                                  ("prose", "prose", "all"), ("correction", "correction", "all"),
                                  ("number", "number", "all"), ("accent", "accent", "all")):
            cells = []
            for lv in levels:
                row = report["results"][lv][method].get(kind)
                cells.append(f"{row[hops]['mean']:>13.1f}" if row else f"{'-':>13}")
            lines.append(f"{'torpor ' + method + ' ' + label:<34}" + " ".join(cells))
        lines.append(f"{'torpor ' + method + ' false recall %':<34}" + " ".join(
            f"{report['results'][lv][method]['all']['false_recall_pct']:>13.2f}"
            for lv in levels))
    for name, target in report["targets"].items():
        lines.append(f"target {name}: {target['value']} -> {'met' if target['met'] else 'MISSED'}")
    return "\n".join(lines)
