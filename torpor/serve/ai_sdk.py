"""The Vercel AI SDK's chat protocol: ``useChat`` / ``DefaultChatTransport`` talk to torpor.

``POST /v1/ai-sdk/chat``               the body ``DefaultChatTransport`` sends (``id``,
                                       ``messages``, ``trigger``, ``messageId``); answers
                                       with a UI message stream
``GET  /v1/ai-sdk/chat/{id}/stream``   resume the answer in flight (a full replay of it),
                                       204 when none is

The wire is the ``ai`` package's UI message stream, v1 (checked against ``ai`` 7):
Server-Sent Events whose ``data`` is one JSON chunk each, the header
``x-vercel-ai-ui-message-stream: v1`` and a final ``data: [DONE]``. One answer is one
UI message (``start`` with its ``messageId``, ``turn-N`` for turn N): a step per model
call (``start-step`` … ``finish-step``), text as ``text-start`` / ``text-delta`` /
``text-end``, each tool call as ``tool-input-available`` and its result as
``tool-output-available`` (``tool-output-error`` for an error result), then
``finish``.

The request's ``id`` is the conversation. Only the newest message is read (the log
holds the rest, so a client may send only that one): a user message's text parts are
sent (``Runtime.send``, its message id the idempotency key, so a retried request
joins the first). An ``ExternalTool`` call the turn suspends on becomes a
``tool-approval-request`` (its ``approvalId`` is the call id) and the stream ends with
``finishReason: "tool-calls"``. The client answers with the SDK's approval response
(``addToolApprovalResponse``): the next POST's newest message is then the assistant
message whose tool part is ``approval-responded`` with ``approval.approved``, and each
such call is resolved (``Runtime.resolve``) with the text ``"approved"`` or
``"denied"`` (``": <reason>"`` appended when the client gave one); the continuation
streams as the rest of that same message, the answered call first
(``tool-output-available``, or ``tool-output-denied`` for a denial).

An aborted turn ends with a ``data-abort`` part holding the abort's fields (``reason``,
``error``, ``retryable``, ``retry_after``, ``status``, ``message``), then the protocol's
``error`` chunk whose ``errorText`` is the abort's user-safe ``message`` (a cancel
sends ``abort`` instead), then ``finish``. Refusals before the stream starts
(authorization, a malformed body, a busy mailbox) are the API's usual
``application/problem+json`` answers, which the SDK raises as its ``APICallError``.

Resuming: ``DefaultChatTransport`` takes a resumed stream as a replay of the whole
answer (``resumeStreamIsReplay``, its default): the GET streams the running turn's
message from its ``start`` (what the log holds, then the text in flight, then live),
which the client rebuilds in place of the one it had.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from torpor.actors.stream import Follower, StreamItem
from torpor.actors.turn import Turn
from torpor.errors import Busy, InvalidInput, TorporError
from torpor.events import (
    Aborted,
    AssistantMessage,
    Suspended,
    ToolResult,
    UserMessage,
    abort_fields_of,
)
from torpor.llm.protocol import TextDelta
from torpor.serve import traces
from torpor.serve.access import Action, Authorize, permit
from torpor.serve.chat import json_body, path_id
from torpor.serve.deferred import Deferred
from torpor.serve.logs import conversation_id_var
from torpor.serve.proxy import Proxy
from torpor.serve.service import Service
from torpor.serve.sse_response import EventStream, encode_event
from torpor.serve.streams import FollowerFrames
from torpor.text import check_id

__all__ = ["APPROVED", "DENIED", "HEADERS", "UIChunks", "ai_sdk_routes", "message_id"]


APPROVED = "approved"  # the result an approved ExternalTool call is resolved with
DENIED = "denied"  # … and a denied one (each "<word>: <reason>" when the client gave one)

HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each chunk on at once
    (b"x-vercel-ai-ui-message-stream", b"v1"),  # the SDK checks for its protocol by this
)
_DONE = encode_event(b"[DONE]")
_RUNNING = ("streaming", "running_tools")  # agent states in which a turn's answer is in flight
_PAGE = 200  # events read per page while looking back for a turn's user message

_encode = msgspec.json.Encoder().encode

Chunk = dict[str, Any]


def message_id(turn: int) -> str:
    """The UI message id of turn ``turn``'s answer (the same in its POST and a resume)."""
    return f"turn-{turn}"


def _is_denial(content: str) -> bool:
    return content == DENIED or content.startswith(DENIED + ": ")


class UIChunks:
    """A conversation follower's items as the UI message chunks of one turn's answer.

    ``live``: whether the text in flight is this turn's from the start (False for a
    postponed turn: another turn streams first, so its text is ignored until an event of
    this turn shows it runs; a step's text not streamed is sent whole at its message).
    ``suspended_after``: a suspension of the turn logged after this position ends the
    stream; one at or before it (a replay of a turn whose answer continues) does not.
    ``approvals``: calls already asked for approval (their results may be denials).
    """

    __slots__ = ("approvals", "done", "live", "message_id", "step_ended", "step_open",
                 "streamed", "suspended_after", "text_id", "texts", "turn")

    def __init__(self, turn: int, message: str, *, live: bool, suspended_after: int,
                 approvals: frozenset[str] = frozenset()) -> None:
        self.turn = turn
        self.message_id = message
        self.live = live
        self.suspended_after = suspended_after
        self.approvals = set(approvals)
        self.text_id: str | None = None  # the open text part
        self.texts = 0
        self.step_open = False
        self.step_ended = False  # the step's model call ended (its tools may still answer)
        self.streamed = 0  # characters of the current step's text sent
        self.done = False

    def start(self) -> Chunk:
        return {"type": "start", "messageId": self.message_id}

    def chunks(self, item: StreamItem) -> list[Chunk]:
        out: list[Chunk] = []
        if self.done:
            return out
        if isinstance(item, TextDelta):
            turn = getattr(item, "turn", None)  # a TurnDelta says whose text it is
            if turn is not None:
                if turn != self.turn:
                    return out
                self.live = True
            if self.live and item.text:
                self._text(out, item.text)
            return out
        if item.turn != self.turn:
            return out  # another turn's (a message postponed behind this one, or before it)
        body = item.body
        if isinstance(body, UserMessage):
            return out
        self.live = True  # this turn runs: the text in flight from now on is its own
        if isinstance(body, AssistantMessage):
            self._assistant(out, body)
        elif isinstance(body, ToolResult):
            self._result(out, body)
        elif isinstance(body, Suspended):
            self._suspended(out, body, ends=item.position > self.suspended_after)
        elif isinstance(body, Aborted):
            self._aborted(out, body)
        return out

    # -- parts ---------------------------------------------------------------------------
    def _step(self, out: list[Chunk]) -> None:
        if self.step_ended:  # the previous model call is over: this is the next step
            out.append({"type": "finish-step"})
            self.step_open = self.step_ended = False
            self.streamed = 0
        if not self.step_open:
            out.append({"type": "start-step"})
            self.step_open = True

    def _text(self, out: list[Chunk], text: str) -> None:
        self._step(out)
        if self.text_id is None:
            self.texts += 1
            self.text_id = f"text-{self.texts}"
            out.append({"type": "text-start", "id": self.text_id})
        out.append({"type": "text-delta", "id": self.text_id, "delta": text})
        self.streamed += len(text)

    def _end_text(self, out: list[Chunk]) -> None:
        if self.text_id is not None:
            out.append({"type": "text-end", "id": self.text_id})
            self.text_id = None

    def _rest(self, out: list[Chunk], full: str, clipped: bool) -> None:
        """What the client lacks of a step's text: all of it when none streamed (a replay,
        a postponed turn), the rest past what streamed otherwise (a clipped message keeps
        only a preview: what streamed was the full text)."""
        if not self.streamed:
            if full:
                self._text(out, full)
        elif not clipped and len(full) > self.streamed:
            self._text(out, full[self.streamed:])

    def _assistant(self, out: list[Chunk], body: AssistantMessage) -> None:
        self._step(out)
        self._rest(out, body.text, body.artifact is not None)
        self._end_text(out)
        for call in body.tool_calls:
            out.append({"type": "tool-input-available", "toolCallId": call.id,
                        "toolName": call.name, "input": call.arguments})
        self.step_ended = True
        if not body.tool_calls:
            self._finish(out, "stop")

    def _result(self, out: list[Chunk], body: ToolResult) -> None:
        if body.call_id in self.approvals and _is_denial(body.content):
            out.append({"type": "tool-output-denied", "toolCallId": body.call_id})
        elif body.is_error:
            out.append({"type": "tool-output-error", "toolCallId": body.call_id,
                        "errorText": body.content})
        else:
            out.append({"type": "tool-output-available", "toolCallId": body.call_id,
                        "output": body.content})

    def _suspended(self, out: list[Chunk], body: Suspended, *, ends: bool) -> None:
        for call_id in body.call_ids:
            self.approvals.add(call_id)
            out.append({"type": "tool-approval-request", "approvalId": call_id,
                        "toolCallId": call_id})
        if ends:
            self._finish(out, "tool-calls")

    def _aborted(self, out: list[Chunk], body: Aborted) -> None:
        self._rest(out, body.partial_text, body.artifact is not None)
        self._end_text(out)
        fields = abort_fields_of(body)
        out.append({"type": "data-abort", "data": {"reason": body.reason, **fields._asdict()}})
        if body.reason == "cancelled":
            out.append({"type": "abort", "reason": fields.message})
            self._finish(out, "other")
        else:
            out.append({"type": "error", "errorText": fields.message})
            self._finish(out, "error")

    def _finish(self, out: list[Chunk], reason: str) -> None:
        self._end_text(out)
        if self.step_open:
            out.append({"type": "finish-step"})
            self.step_open = self.step_ended = False
        out.append({"type": "finish", "finishReason": reason})
        self.done = True


def _frame(chunk: Chunk) -> bytes:
    return encode_event(_encode(chunk))


class _Stream(FollowerFrames):
    """A follower's items as encoded UI message stream chunks."""

    __slots__ = ("_chunks",)

    def __init__(self, follower: Follower, chunks: UIChunks) -> None:
        super().__init__(follower, _frame(chunks.start()))
        self._chunks = chunks

    def _encode(self, item: StreamItem) -> list[bytes]:
        frames = [_frame(chunk) for chunk in self._chunks.chunks(item)]
        if self._chunks.done:
            frames.append(_DONE)
            self._ended = True
        return frames

    def _error(self, exc: TorporError, status: int, title: str) -> list[bytes]:
        """The protocol's error chunk ends it."""
        return [_frame({"type": "error", "errorText": f"{title} ({status})"}), _DONE]


def _latest(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The newest UI message of the body: ``message``, or the last of ``messages``."""
    message = body.get("message")
    if message is None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("messages", "must be a non-empty array of UI messages")
        message = messages[-1]
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        raise InvalidInput("messages", "the newest message must be a UI message with parts")
    return message


def _user_text(message: Mapping[str, Any]) -> str:
    texts = [part["text"] for part in message["parts"]
             if isinstance(part, dict) and part.get("type") == "text"
             and isinstance(part.get("text"), str)]
    if not texts:
        raise InvalidInput("messages", "the newest user message has no text part")
    return "\n".join(texts)


def _answers(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(call id, result) for each tool part the client answered (``approval-responded``)."""
    answers = []
    for part in message["parts"]:
        if not isinstance(part, dict) or part.get("state") != "approval-responded":
            continue
        kind = part.get("type")
        if not isinstance(kind, str) or not (kind.startswith("tool-") or kind == "dynamic-tool"):
            continue
        call_id = part.get("toolCallId")
        approval = part.get("approval")
        if not isinstance(call_id, str) or not isinstance(approval, dict) \
                or not isinstance(approval.get("approved"), bool):
            raise InvalidInput("messages", "an approval-responded tool part needs its "
                               "toolCallId and approval.approved")
        word = APPROVED if approval["approved"] else DENIED
        reason = approval.get("reason")
        answers.append((call_id, f"{word}: {reason}" if isinstance(reason, str) and reason
                        else word))
    return answers


class AISDKChat:
    def __init__(self, service: Service, authorize: Authorize) -> None:
        self.service = service
        self.rt = service.runtime
        self.authorize = authorize

    async def _permit(self, request: Request, conversation_id: str,
                      action: Action) -> Mapping[str, Any] | None:
        conversation_id_var.set(conversation_id)
        return await permit(self.authorize, request, conversation_id, action)

    def _stream(self, follower: Follower, chunks: UIChunks, turn: Turn | None) -> Response:
        on_left = None if turn is None else partial(self.service.client_left, turn)
        return EventStream(_Stream(follower, chunks), self.service.streams, headers=HEADERS,
                           on_left=on_left)

    async def chat(self, request: Request) -> Response:
        body = await json_body(request)
        conversation_id = check_id(body.get("id"), "id")
        metadata = await self._permit(request, conversation_id, "write")
        self.service.admit()
        trigger = body.get("trigger", "submit-message")
        if trigger != "submit-message":
            raise InvalidInput("trigger", f"{str(trigger)[:40]!r} is not supported (the log is "
                               "append-only: send a new message instead)")
        message = _latest(body)
        role = message.get("role")
        if role == "user":
            return await self._send(request, conversation_id, message, metadata)
        if role == "assistant":
            return await self._answer(request, conversation_id, message)
        raise InvalidInput("messages", "the newest message must be a user message, or the "
                           "assistant message holding answered approvals")

    async def _send(self, request: Request, conversation_id: str, message: Mapping[str, Any],
                    metadata: Mapping[str, Any] | None) -> Response:
        text = _user_text(message)
        ui_id = message.get("id")
        key = f"ai-sdk:{ui_id}" if isinstance(ui_id, str) and ui_id else None
        try:
            with traces.joined(request.headers):
                turn = await self.rt.send(conversation_id, text, key=key, metadata=metadata)
        except Busy:
            self.service.metrics.mailbox_refusals.inc()
            raise
        self.service.track(turn)
        after = turn.user_position - 1
        chunks = UIChunks(turn.number, message_id(turn.number), live=not turn.postponed,
                          suspended_after=after)
        return self._stream(self.rt.subscribe(conversation_id, after=after), chunks, turn)

    async def _answer(self, request: Request, conversation_id: str,
                      message: Mapping[str, Any]) -> Response:
        answers = _answers(message)
        if not answers:
            raise InvalidInput("messages", "the newest assistant message answers no approval "
                               "(no tool part in state approval-responded)")
        head = await self.rt.store.head(conversation_id)
        after = -1 if head is None else head
        continuation: Turn | None = None
        keys = []
        with traces.joined(request.headers):
            for call_id, result in answers:
                key = f"ai-sdk:approval:{call_id}"
                keys.append(key)
                turn = await self.rt.resolve(conversation_id, call_id, result, key=key)
                if turn is not None:
                    continuation = turn
        ui_id = message.get("id")
        ours = ui_id if isinstance(ui_id, str) and ui_id else None
        denied = frozenset(call_id for call_id, result in answers if _is_denial(result))
        if continuation is None:  # other calls still wait: the answers are all there is
            frames = [_frame({"type": "start", **({"messageId": ours} if ours else {})})]
            for call_id, _ in answers:
                kind = "tool-output-denied" if call_id in denied else "tool-output-available"
                chunk: Chunk = {"type": kind, "toolCallId": call_id}
                if call_id not in denied:
                    chunk["output"] = dict(answers)[call_id]
                frames.append(_frame(chunk))
            frames += [_frame({"type": "finish", "finishReason": "tool-calls"}), _DONE]
            return Response(b"".join(frames), headers={k.decode(): v.decode() for k, v in HEADERS})
        self.service.track(continuation)
        for key in keys:  # a retried answer streams from the first answer, as it did
            logged = await self.rt.store.keyed(conversation_id, key)
            if logged:
                after = min(after, logged[0].position - 1)
        chunks = UIChunks(continuation.number, ours or message_id(continuation.number),
                          live=True, suspended_after=after, approvals=frozenset(
                              call_id for call_id, _ in answers))
        return self._stream(self.rt.subscribe(conversation_id, after=after), chunks,
                            continuation)

    async def resume(self, request: Request) -> Response:
        conversation_id = path_id(request, "conversation_id", "id")
        await self._permit(request, conversation_id, "read")
        self.service.readable()
        # On a cluster node another node may own it: subscribing raises NotOwner (the proxy
        # then asks the owner, whose memory knows the turn in flight) before anything is read.
        self.rt.subscribe(conversation_id).close()
        # The head first: a suspension logged after it ends the stream, one before it (the
        # agent ran on past it, as inspect then says) is part of the answer being replayed.
        head = await self.rt.store.head(conversation_id)
        if head is None:
            return Response(status_code=204)
        info = await self.rt.admin.inspect(conversation_id)
        if info.state not in _RUNNING or info.turn is None:
            return Response(status_code=204)
        start = await self._user_position(conversation_id, info.turn)
        if start is None:
            return Response(status_code=204)
        chunks = UIChunks(info.turn, message_id(info.turn), live=True, suspended_after=head)
        return self._stream(self.rt.subscribe(conversation_id, after=start - 1), chunks, None)

    async def _user_position(self, conversation_id: str, turn: int) -> int | None:
        """Where turn ``turn``'s user message is in the log (read backwards, a page a trip)."""
        before: int | None = None
        while True:
            events = await self.rt.history(conversation_id, before=before, limit=_PAGE)
            for event in events:
                if event.turn == turn and isinstance(event.body, UserMessage):
                    return event.position
                if event.turn < turn and isinstance(event.body, UserMessage):
                    return None  # messages are logged in turn order: it is not there
            if len(events) < _PAGE or events[-1].position <= 0:
                return None
            before = events[-1].position


def ai_sdk_routes(service: Service, authorize: Authorize, proxy: Proxy) -> list[Route]:
    """The routes; on a cluster node the owner answers for the conversations it owns."""
    api = AISDKChat(service, authorize)
    return [
        # streaming routes run above the routing layers (see torpor.serve.deferred)
        Route("/v1/ai-sdk/chat", Deferred(proxy.route(api.chat)), methods=["POST"]),
        Route("/v1/ai-sdk/chat/{conversation_id:path}/stream",
              Deferred(proxy.route(api.resume)), methods=["GET"]),
    ]
