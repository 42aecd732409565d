"""Conversations as owned data over HTTP: list, delete, export.

``GET    /v1/conversations``               the caller's conversations, newest activity
                                          first (``?prefix=&after=&limit=``): ``{"conversations":
                                          [{id, created_at, last_activity, events, title}],
                                          "next": cursor or null}``; see
                                          :mod:`torpor.serve.access` for how it is filtered
``DELETE /v1/conversations/{id}``          ``Runtime.delete`` ("delete" action): 204, or 404
``GET    /v1/conversations/{id}/export``   ``Runtime.export`` as JSON lines ("read" action),
                                          without the host's metadata (as listed)

On a cluster node a delete goes to the owner (proxied like a send); listing and
exports read the shared store wherever they arrive, as history does.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from torpor.errors import UnknownConversation
from torpor.serve.access import Authorize, list_prefix, permit
from torpor.serve.chat import int_param, json_response, path_id
from torpor.serve.logs import conversation_id_var
from torpor.serve.proxy import Proxy
from torpor.serve.service import Service

__all__ = ["conversation_routes"]

NDJSON = "application/x-ndjson"
_encode = msgspec.json.Encoder()


class ConversationsAPI:
    def __init__(self, service: Service, authorize: Authorize) -> None:
        self.service = service
        self.rt = service.runtime
        self.authorize = authorize

    async def list(self, request: Request) -> Response:
        self.service.readable()
        asked = request.query_params.get("prefix")
        prefix = asked if asked is not None else await list_prefix(self.authorize, request)
        await permit(self.authorize, request, prefix, "list")
        limit = int_param(request, "limit", 50)
        assert limit is not None
        after = request.query_params.get("after") or None
        page = await self.rt.conversations(prefix=prefix or None, after=after, limit=limit)
        shown: list[dict[str, Any]] = []
        for info in page.items:
            if await self._readable(request, info.id):
                shown.append({"id": info.id, "created_at": info.created_at,
                              "last_activity": info.last_activity, "events": info.events,
                              "title": info.title})
        return json_response({"conversations": shown, "next": page.next})

    async def _readable(self, request: Request, conversation_id: str) -> bool:
        verdict = self.authorize(request, conversation_id, "read")
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return verdict is True or isinstance(verdict, Mapping)  # a mapping grants too

    async def delete(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "delete")
        self.service.admit()
        if not await self.rt.delete(conversation_id):
            raise UnknownConversation(conversation_id)
        return Response(status_code=204)

    async def export(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "read")
        self.service.readable()
        records = self.rt.export(conversation_id)
        first = await anext(records)  # UnknownConversation here: a 404, not a cut stream
        first.pop("metadata", None)  # the host's, as in the listing: not the reader's
        return StreamingResponse(_lines(first, records), media_type=NDJSON)

    async def _conversation(self, request: Request, action: Any) -> str:
        conversation_id = path_id(request, "conversation_id", "conversation_id")
        conversation_id_var.set(conversation_id)
        await permit(self.authorize, request, conversation_id, action)
        return conversation_id


async def _lines(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[bytes]:
    yield _encode.encode(first) + b"\n"
    async for record in rest:
        yield _encode.encode(record) + b"\n"


def conversation_routes(service: Service, authorize: Authorize, proxy: Proxy) -> list[Route]:
    """The routes; put before the chat routes' (their ``{id:path}`` would take ``…/export``)."""
    api = ConversationsAPI(service, authorize)
    base = "/v1/conversations/{conversation_id:path}"
    return [
        Route("/v1/conversations", api.list, methods=["GET"]),
        Route(base + "/export", api.export, methods=["GET"]),
        Route(base, proxy.route(api.delete), methods=["DELETE"]),
    ]
