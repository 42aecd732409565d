"""The chat API: JSON in, Server-Sent Events out.

``POST /v1/conversations/{id}/messages``  send; streams the turn (or 202 JSON with
                                         ``Accept: application/json``)
``GET  /v1/conversations/{id}/stream``    follow after ``Last-Event-ID`` / ``?after=`` (its
                                         query twin; ``?turn=N``: that turn only, as its
                                         POST); ``?ticket=`` instead of a bearer token
``POST /v1/conversations/{id}/stream-tickets``  a short-lived ticket for that stream (a
                                         browser's ``EventSource``: :mod:`torpor.serve.tickets`)
``GET  /v1/conversations/{id}/pending``   the calls still waiting for an answer
``GET  /v1/conversations/{id}/history``   scrollback (``?before=&limit=``); never wakes the agent
``GET  /v1/conversations/{id}/recall``    full-text search (``?q=&k=``)
``POST /v1/conversations/{id}/calls/{call_id}``  answer a suspended tool call; streams
                                         the continuation (``Idempotency-Key`` as for
                                         messages: a retry gets the first answer's outcome)
``POST /v1/conversations/{id}/cancel``    cancel the open turn
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import Any
from urllib.parse import unquote_to_bytes

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from torpor.errors import Busy, InvalidInput, UnknownConversation
from torpor.serve import traces
from torpor.serve.access import Action, Authorize, permit
from torpor.serve.deferred import Deferred
from torpor.serve.logs import conversation_id_var
from torpor.serve.problems import HTTPProblem
from torpor.serve.proxy import Proxy
from torpor.serve.service import Service
from torpor.serve.sse import Cursor, event_data, parse_cursor
from torpor.serve.streams import follow_response
from torpor.serve.tickets import StreamTickets, ticket_of
from torpor.serve.turn_scope import turn_span
from torpor.text import check_id

__all__ = ["MAX_BODY_BYTES", "chat_routes", "int_param", "json_body", "path_id"]

MAX_BODY_BYTES = 4 * 1024 * 1024
_decode = msgspec.json.Decoder()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object; its bytes stay on ``request.state.raw_body`` (a request
    proxied to another node, or served again after a fresh lease lookup, sends them again)."""
    kept = getattr(request.state, "raw_body", None)
    if isinstance(kept, bytes):
        return _object(kept)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPProblem(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413,
                          title="Content Too Large", error="BodyTooLarge")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPProblem(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413,
                              title="Content Too Large", error="BodyTooLarge")
    request.state.raw_body = bytes(raw)
    return _object(request.state.raw_body)


def _object(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = _decode.decode(raw)
    except msgspec.DecodeError as exc:
        raise _malformed(f"the body is not JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec checks the encoding as it decodes strings
        raise _malformed(f"the body is not UTF-8 (byte {exc.start})") from None
    except RecursionError:  # msgspec refuses nesting deeper than the interpreter's limit
        raise _malformed("the body nests arrays or objects too deeply") from None
    if not isinstance(value, dict):
        raise InvalidInput("body", "must be a JSON object")
    return value


def _malformed(detail: str) -> HTTPProblem:
    return HTTPProblem(detail, status=400, error="MalformedBody")


def path_id(request: Request, name: str, what: str) -> str:
    """A path parameter as an id. The server decodes ``%XX`` escapes that are not UTF-8 to
    U+FFFD, so two different ids would name one conversation: such a path is refused."""
    value = request.path_params[name]
    if "\ufffd" in value:
        raw = request.scope.get("raw_path")
        if isinstance(raw, bytes):
            try:
                unquote_to_bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(what, "is not UTF-8 once its %XX escapes are decoded") \
                    from None
    return check_id(value, what)


_INTEGER = re.compile(r"-?[0-9]{1,20}")


def int_param(request: Request, name: str, default: int | None) -> int | None:
    """A query parameter as an integer: ASCII digits only, since Python's ``int`` would also
    take ``" 1"``, ``"1_0"`` (10) and other scripts' digits, so ``?turn=1_0`` would be turn 10."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if _INTEGER.fullmatch(raw) is None:
        raise InvalidInput(name, f"must be an integer (ASCII digits, at most 20), got "
                           f"{raw[:40]!r}")
    return int(raw)


def _wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/event-stream" not in accept


class ChatAPI:
    def __init__(self, service: Service, authorize: Authorize,
                 tickets: StreamTickets | None = None) -> None:
        self.service = service
        self.rt = service.runtime
        self.authorize = authorize
        self.tickets = tickets if tickets is not None else StreamTickets()

    async def _conversation(self, request: Request, action: Action) -> str:
        return (await self._granted(request, action))[0]

    async def _granted(
        self, request: Request, action: Action
    ) -> tuple[str, Mapping[str, Any] | None]:
        """The conversation, once ``authorize`` allowed ``action``, and the metadata it
        granted (see :func:`torpor.serve.access.permit`)."""
        conversation_id = path_id(request, "conversation_id", "conversation_id")
        conversation_id_var.set(conversation_id)
        grant = await permit(self.authorize, request, conversation_id, action)
        return conversation_id, grant

    async def _known(self, conversation_id: str) -> int:
        head = await self.rt.store.head(conversation_id)
        if head is None:
            raise UnknownConversation(conversation_id)
        return head

    async def send(self, request: Request) -> Response:
        conversation_id, metadata = await self._granted(request, "write")
        self.service.admit()
        body = await json_body(request)
        text = body.get("text")
        if not isinstance(text, str):
            raise InvalidInput("text", "the body must be {\"text\": \"…\"}")
        if "metadata" in body:  # the server's word about the sender (authorize), never theirs
            raise InvalidInput("metadata", "is set by the server (its authorize hook), not "
                               "by the client")
        key = request.headers.get("idempotency-key")
        try:
            with traces.joined(request.headers):  # the request's trace: the turn span's parent
                turn = await self.rt.send(conversation_id, text, key=key, metadata=metadata)
        except Busy:
            self.service.metrics.mailbox_refusals.inc()
            raise
        joined = self.service.track(turn)
        if _wants_json(request):
            return json_response({
                "conversation_id": conversation_id,
                "position": turn.user_position,
                "turn": turn.number,
                "postponed": turn.postponed,
                # a keyed retry is replayed whether the turn ended (the runtime replays it
                # from the log) or still runs (it joined the turn the first request started)
                "replayed": turn.replayed or joined,
            }, status=202)
        after = turn.user_position - 1  # the stream starts with the user message itself
        follower = self.rt.subscribe(conversation_id, after=after)
        return follow_response(self.service, follower, Cursor(after), until_turn=turn.number,
                               on_left=partial(self.service.client_left, turn))

    async def stream(self, request: Request) -> Response:
        ticket = ticket_of(request)
        if ticket is None:
            conversation_id = await self._conversation(request, "read")
        else:  # the ticket stands for a read permission authorize gave when it was issued
            conversation_id = path_id(request, "conversation_id", "conversation_id")
            conversation_id_var.set(conversation_id)
            self.tickets.check(ticket, conversation_id)
        self.service.readable()
        resume = request.headers.get("last-event-id")
        turn = int_param(request, "turn", None)
        if resume:
            cursor: Cursor | None = parse_cursor(resume)
        elif request.query_params.get("after"):
            cursor = parse_cursor(request.query_params["after"], "after")
        else:
            cursor = None
        if turn is not None:  # one turn's stream, as its POST sent it
            span = await turn_span(self.rt.store, conversation_id, turn)
            if cursor is None:
                cursor = Cursor(span.start - 1)  # the whole turn, from its user message
            elif span.over_for(cursor.position):
                return Response(status_code=204)  # the client has its end: nothing follows
        elif cursor is None:
            head = await self.rt.store.head(conversation_id)
            cursor = Cursor(-1 if head is None else head)
        follower = self.rt.subscribe(conversation_id, after=cursor.position)
        return follow_response(self.service, follower, cursor, until_turn=turn)

    async def stream_ticket(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "read")
        ticket, expires = self.tickets.issue(conversation_id)
        return json_response({"ticket": ticket, "expires_at": expires,
                              "ttl": self.tickets.ttl}, status=201)

    async def history(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "read")
        self.service.readable()
        before = int_param(request, "before", None)
        limit = int_param(request, "limit", 50)
        assert limit is not None
        events = await self.rt.history(conversation_id, before=before, limit=limit)
        if not events:
            await self._known(conversation_id)
        return json_response({
            "events": [event_data(e) for e in events],
            "before": events[-1].position if events and events[-1].position > 0 else None,
        })

    async def pending(self, request: Request) -> Response:
        """The calls still waiting for an answer, from the store's index (what a page shows
        approve/deny buttons for: a history page may end between a call's suspension and
        its answer)."""
        conversation_id = await self._conversation(request, "read")
        self.service.readable()
        calls = await self.rt.store.open_calls(conversation_id)
        if not calls:
            await self._known(conversation_id)
        return json_response({"calls": msgspec.to_builtins(calls)})

    async def recall(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "read")
        self.service.readable()
        query = request.query_params.get("q", "")
        if not query.strip():
            raise InvalidInput("q", "must be a non-empty query")
        k = int_param(request, "k", 10)
        assert k is not None
        hits = await self.rt.recall(conversation_id, query, k)
        if not hits:
            await self._known(conversation_id)
        return json_response({"hits": msgspec.to_builtins(hits)})

    async def resolve(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "write")
        self.service.admit()
        call_id = path_id(request, "call_id", "call_id")
        body = await json_body(request)
        result = body.get("result")
        is_error = body.get("is_error", False)
        if not isinstance(result, str):
            raise InvalidInput("result", "the body must be {\"result\": \"…\"}")
        if not isinstance(is_error, bool):
            raise InvalidInput("is_error", "must be true or false")
        key = request.headers.get("idempotency-key")
        head = await self._known(conversation_id)
        with traces.joined(request.headers):
            turn = await self.rt.resolve(conversation_id, call_id, result, is_error=is_error,
                                         key=key)
        joined = turn is not None and self.service.track(turn)
        if turn is None or _wants_json(request):
            return json_response({"resolved": call_id, "continuation": turn is not None,
                                  "replayed": turn is not None and (turn.replayed or joined)},
                                 status=202)
        if key is not None:  # a retry streams from the answer, as the first one did
            logged = await self.rt.store.keyed(conversation_id, key)
            if logged:
                head = logged[0].position - 1
        follower = self.rt.subscribe(conversation_id, after=head)
        return follow_response(self.service, follower, Cursor(head), until_turn=turn.number,
                               on_left=partial(self.service.client_left, turn))

    async def cancel(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "write")
        self.service.readable()
        cancelled = await self.rt.cancel(conversation_id)
        return JSONResponse({"cancelled": cancelled})


def chat_routes(service: Service, authorize: Authorize, proxy: Proxy,
                tickets: StreamTickets | None = None) -> list[Route]:
    """The routes; on a cluster node the owner answers those another node owns (history,
    recall and pending calls read the shared store here; a ticket needs no owner)."""
    api = ChatAPI(service, authorize, tickets)
    base = "/v1/conversations/{conversation_id:path}"
    owned = proxy.route
    return [
        # the routes that answer with a stream run above the routing layers (see deferred)
        Route(base + "/messages", Deferred(owned(api.send)), methods=["POST"]),
        Route(base + "/stream", Deferred(owned(api.stream)), methods=["GET"]),
        Route(base + "/stream-tickets", api.stream_ticket, methods=["POST"]),
        Route(base + "/history", api.history, methods=["GET"]),
        Route(base + "/pending", api.pending, methods=["GET"]),
        Route(base + "/recall", api.recall, methods=["GET"]),
        Route(base + "/calls/{call_id}", Deferred(owned(api.resolve)), methods=["POST"]),
        Route(base + "/cancel", owned(api.cancel), methods=["POST"]),
    ]
