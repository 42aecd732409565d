"""A conversation's schedules over HTTP (``Runtime.schedule``).

``POST   /v1/conversations/{id}/schedules``        ``{"text", "at" (epoch seconds) |
                                                 "after" (seconds), "every"?, "key"?}``
                                                 ("write" action): 201 and the schedule
``GET    /v1/conversations/{id}/schedules``        its pending schedules ("read"):
                                                 ``{"schedules": [...]}``
``DELETE /v1/conversations/{id}/schedules/{sid}``  cancel one ("write"): 204, or 404

A schedule is ``{id, conversation_id, due (epoch ms), every (seconds or null), text,
key, fired}``. On a cluster node the writes go to the owner (proxied like a send);
the listing reads the shared store wherever it arrives, as history does.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from torpor.errors import InvalidInput, UnknownConversation
from torpor.serve.access import Action, Authorize, permit
from torpor.serve.chat import json_body, json_response, path_id
from torpor.serve.logs import conversation_id_var
from torpor.serve.proxy import Proxy
from torpor.serve.service import Service
from torpor.store.schedules import Schedule

__all__ = ["schedule_routes", "schedule_record"]

_FIELDS = frozenset({"text", "at", "after", "every", "key"})


def schedule_record(schedule: Schedule) -> dict[str, Any]:
    return msgspec.to_builtins(schedule)  # type: ignore[no-any-return]


class SchedulesAPI:
    def __init__(self, service: Service, authorize: Authorize) -> None:
        self.service = service
        self.rt = service.runtime
        self.authorize = authorize

    async def _conversation(self, request: Request, action: Action) -> str:
        conversation_id = path_id(request, "conversation_id", "conversation_id")
        conversation_id_var.set(conversation_id)
        await permit(self.authorize, request, conversation_id, action)
        return conversation_id

    async def add(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "write")
        self.service.admit()
        body = await json_body(request)
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise InvalidInput(unknown[0], f"is not a field of a schedule ({sorted(_FIELDS)})")
        schedule = await self.rt.schedule(
            conversation_id, body.get("text"),  # type: ignore[arg-type]
            at=body.get("at"), after=body.get("after"), every=body.get("every"),
            key=body.get("key"),
        )
        return json_response(schedule_record(schedule), status=201)

    async def list(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "read")
        self.service.readable()
        found = await self.rt.schedules(conversation_id)
        return json_response({"schedules": [schedule_record(s) for s in found]})

    async def remove(self, request: Request) -> Response:
        conversation_id = await self._conversation(request, "write")
        self.service.admit()
        schedule_id = path_id(request, "schedule_id", "schedule_id")
        if not await self.rt.unschedule(conversation_id, schedule_id):
            raise UnknownConversation(
                f"{conversation_id!r} has no pending schedule {schedule_id!r}"
            )
        return Response(status_code=204)


def schedule_routes(service: Service, authorize: Authorize, proxy: Proxy) -> list[Route]:
    """The routes; put before the chat routes' (their ``{id:path}`` would take them)."""
    api = SchedulesAPI(service, authorize)
    base = "/v1/conversations/{conversation_id:path}/schedules"
    return [
        Route(base + "/{schedule_id}", proxy.route(api.remove), methods=["DELETE"]),
        Route(base, proxy.route(api.add), methods=["POST"]),
        Route(base, api.list, methods=["GET"]),
    ]
