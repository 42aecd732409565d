"""``GET /``: one small page (plain HTML and JavaScript, no build step).

A chat with streamed replies, approval buttons for suspended tool calls,
reconnection that loses no text (``Last-Event-ID``), scrollback that loads
older pages, and agents per state updating live from the admin's watch. Tokens
come from the page's fields or its URL fragment (``#token=…&admin=…&c=…``),
which browsers never send to the server.

Every URL it calls is relative to the page, so it works mounted under a prefix
(``host.mount("/chat", app(...))``: the page at ``/chat/`` calls ``/chat/v1/…``).
Approve/deny buttons appear only for calls ``GET …/pending`` lists as open (or
that the stream suspends later), never for one answered since its history page.
Below 760 px wide it is one column.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["page_html", "page_routes"]


@cache
def page_html() -> bytes:
    return resources.files("torpor.serve").joinpath("static/index.html").read_bytes()


async def _page(request: Request) -> Response:
    return Response(
        page_html(),
        media_type="text/html; charset=utf-8",
        headers={
            "Cache-Control": "no-cache",
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; connect-src 'self'",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


def page_routes() -> list[Route]:
    return [Route("/", _page, methods=["GET"])]
