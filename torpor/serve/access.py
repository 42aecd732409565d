"""Who may do what: the ``authorize`` hook, bearer tokens, and the admin token.

The chat API asks ``authorize(request, conversation_id, action)`` before it
touches a conversation (``action`` is ``"read"`` for history, recall, streams and
exports, ``"write"`` for messages, answers and cancels, ``"delete"`` for
``DELETE /v1/conversations/{id}``). It decides before the runtime is consulted,
so a refusal says nothing about whether the conversation exists. The hook returns
a bool (or an awaitable of one), or raises :class:`~torpor.serve.Unauthorized` /
:class:`~torpor.serve.Forbidden`.

Listing (``GET /v1/conversations``) is one range of the store's index, never an
``authorize`` call per conversation in the store:

1. the prefix listed is ``?prefix=`` if given, else the caller's own:
   ``list_prefix(authorize, request)``, which asks the hook's optional
   ``list_prefix(request)`` attribute (``bearer_tokens``: the user's name) and
   is ``""`` (every conversation) for a hook without one;
2. ``authorize(request, prefix, "list")`` decides whether the caller may list
   that prefix (``conversation_id`` is the prefix here); a refusal is a 403;
3. each conversation of the page is then checked with ``"read"`` and left out
   if refused: at most ``limit`` calls per page, so a page may hold fewer than
   ``limit`` (follow ``next`` until it is null).

A custom hook keeps working unchanged: one that answers by the id alone lists
only what it lets the caller read (step 3), and one that refuses actions it does
not know refuses listing and deleting. It must answer ``"delete"`` for the
conversations the caller may delete (treat it at least like ``"write"``), and
should expose ``list_prefix`` when callers own a prefix, or listing pages through
every conversation's index row to find theirs.

It may also return a mapping instead of ``True``: allowed, and for a message
sent through this request (``POST …/messages``) the mapping is the message's
metadata (``Runtime.send(metadata=...)``), which the turn's tools read in their
:class:`~torpor.ToolContext`: who is asking, as the server established it.
:func:`bearer_tokens` returns ``{"user": <the token's user>}``. Clients cannot
set metadata themselves (a body with ``"metadata"`` is refused): what a tool
reads there is the server's word, never the client's.

The admin and ``/metrics`` are not the chat API's business: they need the
admin token, and by default a client on a loopback address. Behind a reverse proxy on
the same host every client has the proxy's loopback address, so that default then
lets everyone through: name the proxies (``trusted_proxies``: their
``X-Forwarded-For`` gives the client's address) and, for clients that are not on
loopback, the networks the admin answers (``admin_allow``); see :class:`AdminClients`.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

from starlette.requests import HTTPConnection

from torpor.serve.problems import Forbidden, Unauthorized

__all__ = [
    "Action",
    "AdminClients",
    "Authorize",
    "Verdict",
    "allow_all",
    "bearer_of",
    "bearer_token",
    "bearer_tokens",
    "check_admin",
    "is_loopback",
    "list_prefix",
    "permit",
]

Action: TypeAlias = Literal["read", "write", "delete", "list"]
Verdict: TypeAlias = "bool | Mapping[str, Any]"
"""What ``authorize`` answers: allowed (True, or a mapping: the metadata of the messages
the request sends), or not (False)."""
Authorize: TypeAlias = Callable[[HTTPConnection, str, Action], "Verdict | Awaitable[Verdict]"]


def bearer_of(request: HTTPConnection) -> str | None:
    """The token of an ``Authorization: Bearer …`` header, None without one."""
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"),
                               b.encode("utf-8", "surrogatepass"))


def allow_all(request: HTTPConnection, conversation_id: str, action: Action) -> bool:
    """No access control (a host that authenticates in front of the app, or a test)."""
    return True


def bearer_token(token: str) -> Authorize:
    """One token that may read and write every conversation (``torpor serve``'s default)."""
    if not token:
        raise ValueError("the token must not be empty")

    def authorize(request: HTTPConnection, conversation_id: str, action: Action) -> bool:
        given = bearer_of(request)
        if given is None:
            raise Unauthorized()
        if not _same(given, token):
            raise Unauthorized("unknown bearer token")
        return True

    return authorize


def bearer_tokens(users: Mapping[str, str], *, separator: str = ":") -> Authorize:
    """A token per user (``{token: user}``); a user owns the conversations named after them.

    User ``alice`` may read, write and delete conversation ``alice`` and every
    conversation whose id starts with ``alice:`` (``separator``), and nothing
    else: not through history, recall, streams, exports, messages, answers, cancels
    or deletes. Listing shows her those (prefix ``alice``, see the module doc).
    The messages she sends carry ``{"user": "alice"}`` as their metadata (a tool
    reads it in ``ToolContext.metadata["user"]``).

    A table where one user name is another followed by the separator (``alice`` and
    ``alice:team``) is refused with ValueError: ``alice`` would own every conversation of
    ``alice:team``. A name may contain the separator when no such other name exists.
    """
    table = dict(users)
    if not table or any(not token or not user for token, user in table.items()):
        raise ValueError("every token and user name must be non-empty")
    if not separator:
        raise ValueError("the separator must not be empty")
    _check_names(set(table.values()), separator)

    def user_of(request: HTTPConnection) -> str:
        given = bearer_of(request)
        if given is None:
            raise Unauthorized()
        user = None
        for token, name in table.items():  # compare with every token: no early exit on a hit
            if _same(given, token):
                user = name
        if user is None:
            raise Unauthorized("unknown bearer token")
        return user

    def authorize(
        request: HTTPConnection, conversation_id: str, action: Action
    ) -> bool | Mapping[str, Any]:
        # "list": conversation_id is the prefix asked for; the user's own (their name, or
        # within "name:") may be listed, its rows then checked with "read".
        user = user_of(request)
        if conversation_id == user or conversation_id.startswith(user + separator):
            return {"user": user}
        return False

    authorize.list_prefix = user_of  # type: ignore[attr-defined]
    return authorize


def _check_names(names: set[str], separator: str) -> None:
    """Refuse names that own each other's conversations (``alice`` owns ``alice:team:…``)."""
    for name in sorted(names):
        at = name.find(separator)
        while at > 0:
            if name[:at] in names:
                raise ValueError(
                    f"user {name[:at]!r} would own the conversations of user {name!r} "
                    f"(its name followed by {separator!r}): rename one of them")
            at = name.find(separator, at + 1)


async def list_prefix(authorize: Authorize, request: HTTPConnection) -> str:
    """The prefix a caller lists by default: the hook's ``list_prefix(request)`` (a str,
    or an awaitable of one), ``""`` (everything) for a hook without one."""
    scope = getattr(authorize, "list_prefix", None)
    if scope is None:
        return ""
    prefix = scope(request)
    if inspect.isawaitable(prefix):
        prefix = await prefix
    if not isinstance(prefix, str):
        raise TypeError(f"authorize.list_prefix returned {type(prefix).__name__}, not str")
    return prefix


async def permit(
    authorize: Authorize, request: HTTPConnection, conversation_id: str, action: Action
) -> Mapping[str, Any] | None:
    """Ask the hook; a refusal raises Forbidden (a 403 that reveals nothing about the id).

    Returns the metadata the hook granted (a mapping it returned), None for ``True``.
    """
    verdict = authorize(request, conversation_id, action)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    if verdict is True:
        return None
    if isinstance(verdict, Mapping):
        return verdict
    raise Forbidden(f"may not {action} this conversation")


def is_loopback(request: HTTPConnection) -> bool:
    client = request.client
    if client is None:  # an in-process transport or a unix socket: local by construction
        return True
    host = client.host
    return host == "::1" or host.startswith("127.") or host in ("localhost", "testclient")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _networks(what: str, values: Iterable[str]) -> tuple[Network, ...]:
    if isinstance(values, str):
        raise ValueError(f"{what} must be a list of addresses or networks, not one string")
    try:
        return tuple(ipaddress.ip_network(v.strip(), strict=False) for v in values)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _address(text: str) -> Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class AdminClients:
    """Which clients the admin and ``/metrics`` answer (the admin token is needed as well).

    ``allow``: the addresses and networks (``"10.0.0.0/8"``, ``"192.0.2.7"``) allowed;
    None: loopback only. ``trusted_proxies``: the proxies whose ``X-Forwarded-For`` is
    believed: for a request from one, the client is the last address of that header that
    is not itself a trusted proxy (a request from one without the header is the proxy's
    own, a local tool say). Anyone else's header is ignored, so it cannot be forged from
    outside. ``remote``: any client at all.
    """

    __slots__ = ("allow", "remote", "trusted")

    def __init__(self, *, allow: Iterable[str] | None = None,
                 trusted_proxies: Iterable[str] | None = None, remote: bool = False) -> None:
        self.allow = None if allow is None else _networks("admin_allow", allow)
        self.trusted = _networks("trusted_proxies", trusted_proxies or ())
        self.remote = remote

    def client(self, request: HTTPConnection) -> Address | str | None:
        """The client's address as the admin sees it (a name for in-process transports)."""
        client = request.client
        if client is None:
            return None
        peer = _address(client.host)
        if peer is None:
            return client.host
        if not self._trusted(peer):
            return peer
        forwarded = ",".join(request.headers.getlist("x-forwarded-for"))
        hops = [_address(hop) for hop in forwarded.split(",") if hop.strip()]
        for hop in reversed(hops):
            if hop is None:
                return "unknown"  # a hop we cannot read: no address to allow
            if not self._trusted(hop):
                return hop
        return hops[0] if hops else peer

    def _trusted(self, address: Address) -> bool:
        return any(address in network for network in self.trusted)

    def allowed(self, request: HTTPConnection) -> bool:
        if self.remote:
            return True
        address = self.client(request)
        if address is None:  # an in-process transport or a unix socket: local
            return True
        if isinstance(address, str):
            return self.allow is None and address in ("localhost", "testclient")
        if self.allow is None:
            return address.is_loopback
        return any(address in network for network in self.allow)


_LOOPBACK = AdminClients()
_ANYONE = AdminClients(remote=True)


def check_admin(request: HTTPConnection, token: str | None, *, remote: bool = False,
                clients: AdminClients | None = None) -> None:
    """The admin token, and a client ``clients`` allows (default: loopback clients, or
    any with ``remote``)."""
    if token is None:
        raise Forbidden("the admin is disabled (no admin token configured)")
    clients = clients if clients is not None else (_ANYONE if remote else _LOOPBACK)
    if not clients.allowed(request):
        raise Forbidden("the admin answers loopback clients only" if clients.allow is None
                        else "the admin does not answer this client's address")
    given = bearer_of(request)
    if given is None:
        raise Unauthorized("the admin needs the admin bearer token")
    if not _same(given, token):
        raise Unauthorized("unknown admin token")
