"""Stream tickets: how a browser's native ``EventSource`` follows a conversation with auth.

``EventSource`` sends no headers, so a bearer token would have to go in the URL,
where proxies and access logs keep it. Instead the page asks for a ticket with its
token (``POST /v1/conversations/{id}/stream-tickets``, read permission) and opens
``GET /v1/conversations/{id}/stream?ticket=…``. A ticket is:

* short-lived (``app(ticket_ttl=60)`` seconds): it is checked when a stream opens,
  an open stream outlives it. ``EventSource`` reconnects with the same URL, so a
  reconnect after the expiry is answered 401 and the client mints a new ticket and
  opens a new ``EventSource`` with ``&after=<the last event id>``;
* for one conversation (another one's stream answers 403) and for reading its stream
  only: no other route looks at it;
* signed, not stored: HMAC-SHA256 over (purpose, expiry, conversation id) with the
  app's secret (``app(ticket_secret=…)``, ``torpor serve --ticket-secret`` or
  ``TORPOR_TICKET_SECRET``; a random one per app when none is given). The nodes of a
  cluster must share the secret: a stream may be opened on any node and is proxied
  to the owner, which checks the ticket again.

The ticket is never logged: access records carry the path without its query, and a
proxied stream passes the ticket on in a header, not in the URL the proxy's HTTP
client logs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from starlette.requests import HTTPConnection

from torpor.serve.problems import Forbidden, Unauthorized

__all__ = ["TICKET_HEADER", "DEFAULT_TICKET_TTL", "StreamTickets", "ticket_of"]

DEFAULT_TICKET_TTL = 60.0
TICKET_HEADER = "x-torpor-ticket"  # how a node passes a ticket on to the owner (not the URL)
_PURPOSE = b"torpor stream ticket v1\n"
_MAX_TICKET = 4096  # a conversation id is at most a few hundred bytes


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def ticket_of(request: HTTPConnection) -> str | None:
    """The ticket a stream request carries (``?ticket=``, or the header a proxying node set)."""
    return request.query_params.get("ticket") or request.headers.get(TICKET_HEADER) or None


class StreamTickets:
    """Issues and checks tickets with one secret (see the module doc)."""

    __slots__ = ("_clock", "_key", "ttl")

    def __init__(self, secret: str | bytes | None = None, ttl: float = DEFAULT_TICKET_TTL,
                 *, clock: Callable[[], float] = time.time) -> None:
        if not ttl > 0:
            raise ValueError(f"ticket_ttl must be > 0 seconds, got {ttl!r}")
        if secret is None:
            key = secrets.token_bytes(32)
        else:
            key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
            if len(key) < 16:
                raise ValueError("ticket_secret must be at least 16 bytes")
        self._key = key
        self.ttl = float(ttl)
        self._clock = clock

    def issue(self, conversation_id: str) -> tuple[str, int]:
        """A ticket for ``conversation_id`` and its expiry (epoch ms)."""
        expires = int((self._clock() + self.ttl) * 1000)
        body = f"{expires}.{_b64(conversation_id.encode('utf-8', 'surrogatepass'))}"
        return f"{body}.{self._sign(body)}", expires

    def check(self, ticket: str, conversation_id: str) -> None:
        """Raises Unauthorized (not a ticket of ours, or expired) or Forbidden (another
        conversation's)."""
        parts = ticket.split(".") if len(ticket) <= _MAX_TICKET else []
        if len(parts) != 3 or not parts[0].isdigit():
            raise Unauthorized("not a stream ticket")
        body = f"{parts[0]}.{parts[1]}"
        if not hmac.compare_digest(self._sign(body).encode("ascii"),
                                   parts[2].encode("utf-8", "surrogatepass")):
            raise Unauthorized("not a stream ticket this server issued")
        if int(parts[0]) <= self._clock() * 1000:
            raise Unauthorized("the stream ticket expired: ask for a new one")
        try:
            named = _unb64(parts[1]).decode("utf-8", "surrogatepass")
        except ValueError:  # signed by us, so never; refused all the same
            raise Unauthorized("not a stream ticket") from None
        if not hmac.compare_digest(named.encode("utf-8", "surrogatepass"),
                                   conversation_id.encode("utf-8", "surrogatepass")):
            raise Forbidden("the stream ticket is for another conversation")

    def _sign(self, body: str) -> str:
        message = _PURPOSE + body.encode("utf-8", "surrogatepass")
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest())
