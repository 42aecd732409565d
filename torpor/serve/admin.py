"""The admin over HTTP, and ``/metrics``: behind the admin token, loopback clients by default
(or the clients an :class:`~torpor.serve.access.AdminClients` allows).

``GET  /admin/agents?state=``                 agents in memory (optionally one state)
``GET  /admin/agents/{id}``                   inspect one (never revives it)
``POST /admin/agents/{id}/hibernate|evict|unpark``
``GET  /admin/stats``                         runtime stats plus this server's figures (model
                                              errors, aborted turns) and pending approvals
``GET  /admin/watch``                         lifecycle transitions as Server-Sent Events
``GET  /admin/pending?limit=&after=``         conversations waiting on an outside answer
``GET  /admin/schedules?limit=&after=``       every conversation's pending schedules, by id
``GET  /admin/calls/{id}/{n}``                the exact rebuilt context of model call ``n``
``GET  /admin/cluster``                       a cluster node's shards, epochs, members, leases
``GET  /metrics``                             Prometheus exposition
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from torpor.errors import InvalidInput
from torpor.runtime.stats import Watcher
from torpor.serve.access import AdminClients, check_admin
from torpor.serve.chat import int_param, json_response
from torpor.serve.deferred import Deferred
from torpor.serve.logs import conversation_id_var
from torpor.serve.metrics import pending_figures
from torpor.serve.problems import HTTPProblem
from torpor.serve.service import Service
from torpor.serve.sse_response import EventStream, encode_event
from torpor.text import check_id

__all__ = ["admin_routes"]

_encode = msgspec.json.Encoder().encode
Handler = Callable[[Request], Awaitable[Response]]


class AdminAPI:
    def __init__(self, service: Service, token: str | None, clients: AdminClients) -> None:
        self.service = service
        self.rt = service.runtime
        self.token = token
        self.clients = clients

    def guarded(self, handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            check_admin(request, self.token, clients=self.clients)
            self.service.readable()
            return await handler(request)

        endpoint.__name__ = handler.__name__
        return endpoint

    def _id(self, request: Request) -> str:
        conversation_id = check_id(request.path_params["conversation_id"])
        conversation_id_var.set(conversation_id)
        return conversation_id

    async def agents(self, request: Request) -> Response:
        state = request.query_params.get("state") or None
        return json_response(msgspec.to_builtins(await self.rt.admin.agents(state)))

    async def inspect(self, request: Request) -> Response:
        info = await self.rt.admin.inspect(self._id(request))
        return json_response(msgspec.to_builtins(info))

    async def hibernate(self, request: Request) -> Response:
        return json_response({"done": await self.rt.admin.hibernate(self._id(request))})

    async def evict(self, request: Request) -> Response:
        return json_response({"done": await self.rt.admin.evict(self._id(request))})

    async def unpark(self, request: Request) -> Response:
        return json_response({"done": await self.rt.admin.unpark(self._id(request))})

    async def stats(self, request: Request) -> Response:
        stats = msgspec.to_builtins(await self.rt.admin.stats())
        stats["server"] = {**self.service.server_stats(), **self.service.metrics.failures()}
        stats["pending"] = pending_figures(await self.rt.store.pending_summary())
        return json_response(stats)

    async def cluster(self, request: Request) -> Response:
        view = await self.rt.admin.cluster()
        if view is None:
            raise HTTPProblem("this server is not a node of a cluster (torpor serve --node-id)",
                              status=404, title="Not a Cluster Node", error="NotClusterNode")
        return json_response(msgspec.to_builtins(view))

    async def pending(self, request: Request) -> Response:
        limit = int_param(request, "limit", 100)
        assert limit is not None
        after = request.query_params.get("after") or None
        return json_response(msgspec.to_builtins(await self.rt.admin.pending(limit, after)))

    async def schedules(self, request: Request) -> Response:
        limit = int_param(request, "limit", 100)
        assert limit is not None
        after = request.query_params.get("after") or None
        return json_response(msgspec.to_builtins(await self.rt.admin.schedules(limit, after)))

    async def branches(self, request: Request) -> Response:
        return json_response(msgspec.to_builtins(await self.rt.admin.branches(self._id(request))))

    async def rendered(self, request: Request) -> Response:
        raw = request.path_params["n"]
        try:
            n = int(raw)
        except ValueError:
            raise InvalidInput("n", f"must be a model call number, got {raw[:40]!r}") from None
        call = await self.rt.admin.rendered(self._id(request), n)
        return json_response(msgspec.to_builtins(call))

    async def watch(self, request: Request) -> Response:
        return EventStream(_Transitions(self.rt.admin.watch()), self.service.streams)

    async def metrics(self, request: Request) -> Response:
        body = await self.service.metrics.scrape(self.rt)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


class _Transitions:
    """An admin watcher's transitions as encoded events (the stream's source)."""

    __slots__ = ("watcher",)

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    async def open(self) -> None:
        pass

    def take(self) -> bytes | None:
        watcher = self.watcher
        if watcher.items:
            return encode_event(_encode(watcher.items.popleft()), event="transition")
        if not watcher.open:
            raise StopAsyncIteration
        return None

    def wake_on(self, future: asyncio.Future[None] | None) -> None:
        self.watcher.waiter = future

    def close(self) -> None:
        self.watcher.close()


def admin_routes(service: Service, token: str | None, clients: AdminClients) -> list[Route]:
    api = AdminAPI(service, token, clients)
    g = api.guarded
    agent = "/admin/agents/{conversation_id:path}"
    return [
        Route("/admin/agents", g(api.agents), methods=["GET"]),
        Route(agent + "/hibernate", g(api.hibernate), methods=["POST"]),
        Route(agent + "/evict", g(api.evict), methods=["POST"]),
        Route(agent + "/unpark", g(api.unpark), methods=["POST"]),
        Route(agent, g(api.inspect), methods=["GET"]),
        Route("/admin/stats", g(api.stats), methods=["GET"]),
        Route("/admin/watch", Deferred(g(api.watch)), methods=["GET"]),
        Route("/admin/pending", g(api.pending), methods=["GET"]),
        Route("/admin/schedules", g(api.schedules), methods=["GET"]),
        Route("/admin/cluster", g(api.cluster), methods=["GET"]),
        Route("/admin/branches/{conversation_id:path}", g(api.branches), methods=["GET"]),
        Route("/admin/calls/{conversation_id:path}/{n}", g(api.rendered), methods=["GET"]),
        Route("/metrics", g(api.metrics), methods=["GET"]),
    ]
