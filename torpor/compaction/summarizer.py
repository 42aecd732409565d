"""ModelSummarizer: a model writes the handoff of a fold (design source 002's compaction
snapshot), beside the pointer markers, never instead of them.

At a fold the summarizer is shown the previous summary and the folded span of
the log, and asked for two things: an episodic summary (what happened, in
order: asked, done, decided, left open) and the durable facts (preferences,
constraints, decisions, exact names and numbers) that must survive the fold.
The answer is stored in ``Checkpoint.summary`` and rendered after the markers,
so ``recall``/``expand`` still reach every folded word.

A summary is an optimisation, not a dependency: a summarizer call that fails,
times out or answers nothing leaves a marker-only handoff for that span (the
previous summary is carried over), and the turn goes on. Its call is audited
in ``model_calls`` like any other, with ``purpose="summary"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec

from torpor._logging import get_logger
from torpor.compaction.extraction import ItemDraft, parse_answer
from torpor.compaction.recipe import Recipe, encode_recipe, payload_hash
from torpor.compaction.tokens import DEFAULT_ENCODING, MESSAGE_OVERHEAD, count_text, get_encoding
from torpor.errors import ConfigError, ModelError
from torpor.events import Aborted, AssistantMessage, Event, ToolResult, UserMessage
from torpor.llm.closing import close_quietly
from torpor.llm.protocol import ContextMessage, SystemMessage, TextDelta, Usage
from torpor.store.protocol import ModelCall
from torpor.text import repair_text

if TYPE_CHECKING:
    from torpor.compaction.fold import Summarizer
    from torpor.compaction.policy import CompactionPolicy
    from torpor.llm.protocol import Model
    from torpor.store.protocol import Checkpoint

__all__ = ["DEFAULT_INSTRUCTIONS", "ModelSummarizer", "SummaryOutcome", "summarize_fold"]

DEFAULT_INSTRUCTIONS = """\
You keep the memory of a long conversation between a user and an assistant. The turns \
below are being folded out of the assistant's working context; the full log stays \
searchable, but the assistant will only see what you write here. Write the handoff.

Answer in exactly this form, within {max_tokens} tokens:

EPISODE:
A few sentences: what happened in these turns, in order. What was asked, what was done, \
what was decided, what is still open.

FACTS:
- One durable fact, preference, constraint or decision per line, phrased to stand on its \
own. Keep exact names, numbers, identifiers, paths and URLs.

ITEMS:
A JSON list with one object per line of FACTS: {"kind": "fact" | "preference" | \
"constraint" | "decision", "key": a short stable name for what it is about (reuse the \
same key when a fact replaces an earlier one), "text": the line, "confidence": 0 to 1}.

If a previous summary is given, merge it in: keep what still holds, drop what the new \
turns superseded. Do not invent anything that is not in the turns."""

log = get_logger(__name__)

_RESULT_CHARS = 1_500  # a tool result is shown up to this many characters
_MESSAGE_CHARS = 6_000  # a message is shown up to this many characters


class SummaryOutcome(msgspec.Struct, frozen=True, gc=False):
    """One summarizer call: its text (empty when it failed) and what it cost."""

    text: str
    model: str
    start: int  # first folded position
    end: int  # last folded position
    rendered_hash: str
    sections: dict[str, int]
    estimated_tokens: int
    usage: Usage | None
    latency_ms: float
    ttft_ms: float | None
    error: str | None
    created_at: int
    # What the answer holds besides the handoff (torpor.compaction.extraction): the span's
    # episode and the structured items; ``items_problem`` says why items are missing.
    episode: str = ""
    items: tuple[ItemDraft, ...] = ()
    items_problem: str | None = None

    def model_call(
        self,
        conversation_id: str,
        turn: int,
        call_index: int,
        cycle: int,
        previous: Checkpoint | None,
        policy: CompactionPolicy,
    ) -> ModelCall:
        """The audit row of this call (``purpose="summary"``): its recipe names the folded
        span and the checkpoint it folds onto."""
        usage = self.usage
        recipe = Recipe(
            checkpoint_position=previous.position if previous is not None else None,
            cycle=previous.cycle if previous is not None else 0,
            tail_start=self.start,
            tail_end=self.end,
            encoding=policy.encoding,
        )
        return ModelCall(
            conversation_id=conversation_id,
            turn=turn,
            call_index=call_index,
            compaction_cycle=cycle,
            recipe=encode_recipe(recipe),
            rendered_hash=self.rendered_hash,
            sections=dict(self.sections),
            estimated_prompt_tokens=self.estimated_tokens,
            utilization=self.estimated_tokens / policy.input_budget,
            reported_prompt_tokens=usage.prompt_tokens if usage is not None else None,
            completion_tokens=usage.completion_tokens if usage is not None else None,
            latency_ms=self.latency_ms,
            ttft_ms=self.ttft_ms,
            created_at=self.created_at,
            model=self.model,
            error=self.error,
            cache_read_tokens=usage.cache_read_tokens if usage is not None else None,
            cache_write_tokens=usage.cache_write_tokens if usage is not None else None,
            purpose="summary",
        )


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" […{len(text) - limit} more characters]"


def _event_line(event: Event) -> str | None:
    body = event.body
    at = f"[{event.position}]"
    if isinstance(body, UserMessage):
        return f"{at} user: {_clip(body.text, _MESSAGE_CHARS)}"
    if isinstance(body, AssistantMessage):
        parts = []
        if body.text:
            parts.append(f"{at} assistant: {_clip(body.text, _MESSAGE_CHARS)}")
        for call in body.tool_calls:
            arguments = msgspec.json.encode(call.arguments).decode()
            parts.append(f"{at} assistant called {call.name}({_clip(arguments, _RESULT_CHARS)})")
        return "\n".join(parts) if parts else None
    if isinstance(body, ToolResult):
        verb = "failed" if body.is_error else "returned"
        return f"{at} {body.tool} {verb}: {_clip(body.content, _RESULT_CHARS)}"
    if isinstance(body, Aborted):
        if body.partial_text:
            return f"{at} assistant (interrupted, {body.reason}): " + _clip(
                body.partial_text, _MESSAGE_CHARS
            )
        return f"{at} (turn aborted: {body.reason})"
    return None


class ModelSummarizer:
    """A :class:`~torpor.compaction.Summarizer` that asks ``model`` for the fold's handoff.

    ``instructions``: the summarizer's system prompt (``{max_tokens}`` is filled
    in); ``max_output_tokens``: the summary is cut there (the model is told the
    bound, and reading stops past it); ``max_input_tokens``: the transcript of
    the folded span shown to the model is kept under this (oldest events left
    out first, tool results and long messages clipped); ``timeout``: seconds
    for the whole call (None: no limit of its own). ``memory_budget``: tokens
    of the memory bundle a fold renders from the episodic and semantic items
    it writes (0: write the items, show none of them). Give it a cheaper model
    than the conversation's if you like: it is any torpor Model.
    """

    def __init__(
        self,
        model: Model,
        *,
        instructions: str = DEFAULT_INSTRUCTIONS,
        max_output_tokens: int = 600,
        max_input_tokens: int = 12_000,
        timeout: float | None = 120.0,
        encoding: str = DEFAULT_ENCODING,
        memory_budget: int = 600,
    ) -> None:
        if not callable(getattr(model, "stream", None)):
            raise ConfigError("model", f"must be a torpor Model, got {type(model).__name__}")
        if type(max_output_tokens) is not int or max_output_tokens < 1:
            raise ConfigError("max_output_tokens", f"must be an integer >= 1, got "
                                                   f"{max_output_tokens!r}")
        if type(max_input_tokens) is not int or max_input_tokens < 100:
            raise ConfigError("max_input_tokens", f"must be an integer >= 100, got "
                                                  f"{max_input_tokens!r}")
        if type(memory_budget) is not int or memory_budget < 0:
            raise ConfigError("memory_budget", f"must be an integer >= 0, got {memory_budget!r}")
        if timeout is not None and not timeout > 0:
            raise ConfigError("timeout", f"must be None or > 0, got {timeout!r}")
        if not isinstance(instructions, str) or not instructions.strip():
            raise ConfigError("instructions", "must be a non-empty string")
        self.model = model
        self.instructions = instructions
        self.max_output_tokens = max_output_tokens
        self.max_input_tokens = max_input_tokens
        self.timeout = timeout
        self.encoding = encoding
        self.memory_budget = memory_budget
        get_encoding(encoding)  # an unknown encoding fails here, not at the first fold

    @property
    def name(self) -> str:
        return str(getattr(self.model, "name", type(self.model).__name__))

    def prompt(self, previous_summary: str, events: Sequence[Event]) -> list[ContextMessage]:
        """The messages the model is sent for this fold."""
        system, body = self._texts(previous_summary, events)
        return [SystemMessage(system), UserMessage(body)]

    def _texts(self, previous_summary: str, events: Sequence[Event]) -> tuple[str, str]:
        system = self.instructions.replace("{max_tokens}", str(self.max_output_tokens))
        head = "Previous summary:\n" + (previous_summary.strip() or "(none)") + "\n\n"
        # What is left for the events once the instructions, the previous summary and the
        # transcript's heading (a line or two, reserved) are paid for.
        budget = self.max_input_tokens - count_text(system + head, self.encoding) - 40
        lines: list[str] = []
        for event in reversed(events):  # newest first while they fit
            line = _event_line(event)
            if line is None:
                continue
            cost = count_text(line, self.encoding) + 1
            if cost > budget:
                if budget > 50:  # the newest that does not fit is shown in part
                    lines.append(self._clip_tokens(line, budget - 10))
                break
            budget -= cost
            lines.append(line)
        lines.reverse()
        shown = len(lines)
        rendered = sum(1 for e in events if _event_line(e) is not None)
        span = (f"events {events[0].position}-{events[-1].position}" if events else "no events")
        intro = f"Folded turns ({span} of the log):\n"
        if shown < rendered:
            intro += (f"[{rendered - shown} earlier events left out for length; the pointer "
                      "markers still name them]\n")
        return system, head + intro + "\n".join(lines)

    async def summarize(self, previous_summary: str, events: Sequence[Event]) -> str:
        """The Summarizer protocol: the handoff text; a failed call raises ModelError."""
        outcome = await self.run(previous_summary, events)
        if outcome.error is not None:
            raise ModelError(outcome.error)
        return outcome.text

    async def run(self, previous_summary: str, events: Sequence[Event]) -> SummaryOutcome:
        """Call the model and report everything; a failure is in ``error``, never raised
        (cancellation excepted: it propagates, and the model's stream is closed)."""
        system, body = self._texts(previous_summary, events)
        messages: list[ContextMessage] = [SystemMessage(system), UserMessage(body)]
        sections = {
            "system": count_text(system, self.encoding) + MESSAGE_OVERHEAD,
            "transcript": count_text(body, self.encoding) + MESSAGE_OVERHEAD,
        }
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        usage: Usage | None = None
        error: str | None = None
        # Past this, surely past the token bound (twice it: the ITEMS list comes on top).
        limit_chars = self.max_output_tokens * 16
        length = 0
        stream = self.model.stream(messages, ())
        try:
            with anyio.fail_after(self.timeout):
                async for item in stream:
                    if isinstance(item, TextDelta):
                        if first is None:
                            first = time.perf_counter()
                        parts.append(item.text)
                        length += len(item.text)
                        if length > limit_chars:
                            break
                    elif isinstance(item, Usage):
                        usage = item
        except ModelError as exc:  # ModelTimeout too: the model's own, not our deadline
            error = f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            error = f"ModelTimeout: the summarizer's model took longer than {self.timeout:g} s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            await close_quietly(stream, "aclose")
        text = ""
        extraction = None
        if error is None:
            extraction = parse_answer(repair_text("".join(parts)))
            text = self._bounded(extraction.summary)
            if not text:
                error = "ModelError: the summarizer's model answered with no text"
            elif extraction.problem is not None:
                log.warning("summary_items_unreadable", problem=extraction.problem,
                            model=self.name)
        now = time.perf_counter()
        return SummaryOutcome(
            text=text,
            model=self.name,
            start=events[0].position if events else 0,
            end=max(e.position for e in events) if events else 0,
            rendered_hash=payload_hash(messages, ()),
            sections=sections,
            estimated_tokens=sum(sections.values()),
            usage=usage,
            latency_ms=(now - started) * 1000.0,
            ttft_ms=(first - started) * 1000.0 if first is not None else None,
            error=error,
            created_at=int(time.time() * 1000),
            episode=self._bounded(extraction.episode) if extraction and text else "",
            items=extraction.items if extraction and text else (),
            items_problem=extraction.problem if extraction else None,
        )

    def _bounded(self, text: str) -> str:
        return self._clip_tokens(text, self.max_output_tokens)

    def _clip_tokens(self, text: str, limit: int) -> str:
        """``text`` cut to ``limit`` tokens, marked when cut."""
        encoding = get_encoding(self.encoding)
        tokens = encoding.encode_ordinary(text)
        if len(tokens) <= limit:
            return text
        return encoding.decode(tokens[:limit], errors="ignore").rstrip() + " […]"

    def __repr__(self) -> str:
        return f"ModelSummarizer(model={self.name!r}, max_output_tokens={self.max_output_tokens})"


async def summarize_fold(
    summarizer: Summarizer, previous_summary: str, events: Sequence[Event]
) -> tuple[str, SummaryOutcome | None]:
    """A fold's summary, and the audit of the call when the summarizer is a model.

    A ModelSummarizer never fails the fold (its failure leaves the summary empty:
    a marker-only handoff for this span). Any other Summarizer is awaited as the
    protocol says; what it raises propagates, as it always has.
    """
    if isinstance(summarizer, ModelSummarizer):
        outcome = await summarizer.run(previous_summary, events)
        return outcome.text, outcome
    return await summarizer.summarize(previous_summary, events), None
