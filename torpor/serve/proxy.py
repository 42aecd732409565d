"""Routing through any node: a request for a conversation another node owns is proxied there.

On a cluster node (``Runtime(node=...)``, ``torpor serve --node-id``) the
runtime refuses a request for a shard it does not serve with
:class:`~torpor.errors.NotOwner` (``.owner``: the owner's address). The chat
routes catch it and forward the request to that address with one pooled
``httpx.AsyncClient`` the app's lifespan opens and closes; the answer is
relayed as it arrives (a Server-Sent Events stream event by event, never
buffered whole; ``Last-Event-ID`` and every other end-to-end header pass
through, so a reconnect resumes exactly as on the owner).

* Loops: a forwarded request carries ``X-Torpor-Hop`` (the forwarding node's
  id). A node that is not the owner either answers it 421 (``NotOwner`` with
  the owner it knows) instead of forwarding it again.
* A shard in hand-off (``NotOwner.moving``: leaving this node, or about to be
  acquired by it): the request waits, bounded (about the hand-off deadline plus
  two lease refreshes), for the lease to land, then is served here or proxied
  to the new owner, as Akka buffers messages for a shard in hand-off.
* A stale cache: when the target refuses (421) or cannot be reached before
  anything was sent, the lease table is read afresh from the database and the
  request goes once more, to the owner it names (or is served here, if this
  node took the shard meanwhile); while the database cannot answer, by this
  node's lease cache. Nothing is retried once the owner may have acted on it,
  except below.
* An owner that stops answering (paused, partitioned): while waiting for its
  response to begin, the proxy watches this node's lease cache; once the
  shard's lease moved (within about the TTL), a request that is safe to repeat
  (GET, or one with an ``Idempotency-Key``) goes to the new owner, any other is
  answered ``OwnerUnreachable``.
* The owner unreachable: :class:`~torpor.serve.OwnerUnreachable`, a 503 with
  ``Retry-After`` (before the response began), or an SSE ``error`` event of
  that name (mid-stream): retry, with the same ``Idempotency-Key``.

``app(..., cluster_routing="redirect")`` answers 421 with the owner's address
instead (the client goes there itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import anyio
import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from torpor._logging import get_logger
from torpor.cluster import shard_of
from torpor.errors import NotOwner, StoreUnavailable
from torpor.runtime import Runtime
from torpor.serve.problems import OwnerUnreachable
from torpor.serve.tickets import TICKET_HEADER
from torpor.serve.traces import forwarded

__all__ = ["HOP_HEADER", "Proxy", "Routing"]

log = get_logger("torpor.serve")

Routing = Literal["proxy", "redirect"]
Handler = Callable[[Request], Awaitable[Response]]

NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
HOP_HEADER = "x-torpor-hop"
OWNER_HEADER = "x-torpor-owner"  # on a relayed response: the node that served it
CONNECT_SECONDS = 2.0
HEADERS_SECONDS = 10.0  # the owner's response must begin within this
# Between two reads of a relayed body: the owner pings an idle stream every 15 s.
READ_SECONDS = 40.0
# RFC 9110 section 7.6.1 hop-by-hop headers, and those the client library sets itself.
_NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})
_NOT_RELAYED = _NOT_FORWARDED | {"x-request-id", "date", "server"}
_BEFORE_SENDING = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_SAFE_METHODS = frozenset({"GET", "HEAD"})
MAX_MOVES = 2  # re-routings of one request after its owner's lease moved
MAX_HINTS = 2  # re-routings of one request to the owner named by a node that refused it


class _Moved:
    """What :meth:`Proxy._open` returns when the owner's lease moved before it answered."""


MOVED = _Moved()


class Proxy:
    """The app's forwarding to other nodes; its client lives as long as the app's lifespan."""

    def __init__(self, runtime: Runtime, routing: Routing) -> None:
        self.rt = runtime
        self.routing = routing
        self.node_id: str | None = None  # set while running on a cluster node
        self.address: str | None = None  # this node's advertised address, then
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the pooled client for the app's lifespan (only on a cluster node)."""
        node = self.rt.node if self.routing == "proxy" else None
        if node is None:
            yield
            return
        self.node_id = node.node_id  # from the config: starting needs no database read
        self.address = node.address
        timeout = httpx.Timeout(READ_SECONDS, connect=CONNECT_SECONDS, pool=CONNECT_SECONDS)
        # A relayed request is written in pieces (headers, body): no Nagle delay between them.
        transport = httpx.AsyncHTTPTransport(socket_options=[NODELAY])
        async with httpx.AsyncClient(timeout=timeout, trust_env=False,
                                     transport=transport) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    def route(self, handler: Handler) -> Handler:
        """``handler``, with a NotOwner answered by the owner (when proxying)."""

        async def routed(request: Request) -> Response:
            try:
                return await self._here(request, handler)
            except NotOwner as exc:
                if self._client is None or request.headers.get(HOP_HEADER):
                    raise  # redirect mode, or already forwarded once: 421 with the owner
                return await self._forward(request, handler, exc)

        return routed

    async def _here(self, request: Request, handler: Handler) -> Response:
        """``handler``; for a shard in hand-off through this node, once more after its
        lease landed (bounded wait): served here then, or NotOwner naming the new owner.
        The handler refuses before acting, and the body is kept: running it again is safe."""
        try:
            return await handler(request)
        except NotOwner as exc:
            if not exc.moving:
                raise
            log.debug("shard_in_handoff", shard=exc.shard)
            await self.rt.admin.settled(exc.conversation_id)
        return await handler(request)

    async def _forward(self, request: Request, handler: Handler, refused: NotOwner) -> Response:
        conversation_id = refused.conversation_id
        target = refused.owner
        looked_up = False
        moves = MAX_MOVES
        hints = MAX_HINTS
        while True:
            if target is not None:
                upstream = await self._open(request, target, conversation_id)
                if upstream is MOVED and moves > 0:
                    moves -= 1
                    try:  # by the cache that saw the lease move: here, or the new owner
                        return await self._here(request, handler)
                    except NotOwner as exc:
                        target = exc.owner
                        continue
                if isinstance(upstream, httpx.Response):
                    if upstream.status_code != 421:
                        return _Relay(upstream, target)
                    # Not the owner either (a cache was stale): it names the owner it knows,
                    # fresher than ours when the shard just left it.
                    named = await _named_owner(upstream)
                    if named is not None and named != target and hints > 0:
                        hints -= 1
                        if named == self.address:
                            try:
                                return await self._here(request, handler)
                            except NotOwner as exc:
                                named = exc.owner
                        target = named
                        continue
            if looked_up:
                break
            looked_up = True
            owner = await self._fresh_owner(conversation_id)
            if owner == "":  # this node holds the shard now
                try:
                    return await self._here(request, handler)
                except NotOwner as exc:
                    owner = exc.owner
            target = owner
        raise OwnerUnreachable(
            f"the node that owns conversation {conversation_id!r} "
            f"({target or 'none live yet'}) could not be reached; retry shortly"
        )

    async def _open(
        self, request: Request, target: str, conversation_id: str
    ) -> httpx.Response | _Moved | None:
        """The owner's response, begun (None: nothing reached it, or it refused at once;
        MOVED: its lease moved before it answered, and the request may be repeated)."""
        client = self._client
        assert client is not None and self.node_id is not None
        headers = [(k, v) for k, v in request.headers.items()
                   if k not in _NOT_FORWARDED and k != "x-request-id"]
        headers = forwarded(headers)  # the trace goes on (the client's, or this node's span)
        headers.append((HOP_HEADER, self.node_id))
        request_id = getattr(request.state, "request_id", None)
        if isinstance(request_id, str):  # the owner logs this request under the same id
            headers.append(("x-request-id", request_id))
        body = getattr(request.state, "raw_body", None)
        if body is None:
            body = await request.body()
        url = f"http://{target}{request.url.path}"
        params: Any = request.url.query or None
        if "ticket" in request.query_params:  # on in a header: httpx logs the URLs it requests
            headers.append((TICKET_HEADER, request.query_params["ticket"]))
            params = [(k, v) for k, v in request.query_params.multi_items() if k != "ticket"]
        outgoing = client.build_request(request.method, url, params=params or None,
                                        headers=headers, content=body)
        sending = asyncio.ensure_future(client.send(outgoing, stream=True))
        # While the owner has not answered, its lease may move (it stopped renewing):
        # watched in this node's lease cache, so a paused owner costs about a TTL, not
        # HEADERS_SECONDS.
        watching = asyncio.ensure_future(self.rt.admin.moved(conversation_id, target))
        watching.add_done_callback(_retrieved)  # cancelled unread most of the time
        try:
            await asyncio.wait({sending, watching}, timeout=HEADERS_SECONDS,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            watching.cancel()
            await _drop(sending)
            raise
        if sending.done():
            watching.cancel()
            error = sending.exception()
            if error is None:
                return sending.result()
            if isinstance(error, _BEFORE_SENDING):
                log.warning("owner_unreachable", owner=target, error=repr(error))
                return None
            if not isinstance(error, httpx.HTTPError):
                raise error
            # It may have acted on the request: not retried here (the client retries
            # under its Idempotency-Key).
            log.warning("owner_no_answer", owner=target, error=repr(error))
            raise OwnerUnreachable(
                f"the node at {target} that owns this conversation did not answer; retry"
            )
        await _drop(sending)
        if not watching.done():
            watching.cancel()
            log.warning("owner_no_answer", owner=target, seconds=HEADERS_SECONDS)
            raise OwnerUnreachable(
                f"the node at {target} that owns this conversation did not answer; retry"
            )
        route = watching.result()
        repeatable = request.method in _SAFE_METHODS or "idempotency-key" in request.headers
        log.warning("owner_moved", owner=target, to=route.owner if route else None,
                    repeated=repeatable)
        if repeatable:
            return MOVED
        raise OwnerUnreachable(
            f"the node at {target} stopped answering and its shard moved; it may have acted "
            "on this request: retry (with an Idempotency-Key, a retry is never applied twice)"
        )

    async def _fresh_owner(self, conversation_id: str) -> str | None:
        """The owner's address by the lease table read now ("": this node; None: none live).

        While the database cannot answer (an outage), and for a shard whose lease is free
        or expired, by this node's lease cache: the node every node computes as its owner,
        which acquires it next."""
        try:
            view = await self.rt.admin.cluster()
        except StoreUnavailable as exc:
            log.debug("lease_table_unreadable", error=str(exc))  # the store logs the outage
            view = None
        route = await self.rt.admin.route(conversation_id)
        if route is None:
            return None
        by_cache = "" if route.serving or route.moving else route.owner
        if view is None:
            return by_cache
        shard = shard_of(conversation_id, view.shard_count)
        if shard in view.shards:
            return ""
        lease = next((x for x in view.leases if x.shard == shard), None)
        if lease is None or not lease.live:
            return by_cache
        if lease.owner == view.node_id:
            return None  # ours in the table, not held here: being handed off or dropped
        return lease.address


async def _named_owner(refusal: httpx.Response) -> str | None:
    """The ``owner`` a 421 problem names (None: none, or not a problem of ours)."""
    try:
        body = await refusal.aread()
        owner = msgspec.json.decode(body[:4096]).get("owner")
    except (httpx.HTTPError, msgspec.DecodeError, AttributeError):
        return None
    finally:
        await refusal.aclose()
    return owner if isinstance(owner, str) else None


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel a request to an owner and close its response if it began meanwhile."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        response = task.result()
        with anyio.CancelScope(shield=True):
            await response.aclose()


class _Relay(Response):
    """The owner's response as it arrives; a stream cut by the owner ends with an error event."""

    def __init__(self, upstream: httpx.Response, owner: str) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in upstream.headers.multi_items() if k.lower() not in _NOT_RELAYED
        ]
        self.raw_headers.append((OWNER_HEADER.encode(), owner.encode("latin-1")))
        self.owner = owner
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def relay() -> None:
                    await self._relay(send)
                    group.cancel_scope.cancel()

                group.start_soon(relay)
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()  # the client left: stop reading the owner
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        held = b""  # the start of an SSE event not yet complete
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.sse:  # whole events only, so a cut stream never ends mid-event
                    held += chunk
                    end = _events_end(held)
                    chunk, held = held[:end], held[end:]
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, httpx.HTTPError) as exc:
            log.warning("owner_stream_cut", owner=self.owner,
                        error=repr(exc))
            if self.sse:
                await send({"type": "http.response.body", "body": _error_event(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _events_end(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends (0: none complete)."""
    return max(
        (i + len(sep) for sep in (b"\r\n\r\n", b"\n\n", b"\r\r") if (i := data.rfind(sep)) >= 0),
        default=0,
    )


def _error_event() -> bytes:
    error = OwnerUnreachable("the node that owns this conversation went away mid-stream; "
                             "reconnect with Last-Event-ID")
    data = msgspec.json.encode({"status": error.status, "title": error.title,
                                "error": "OwnerUnreachable", "detail": error.detail})
    return b"event: error\r\ndata: " + data + b"\r\n\r\n"
