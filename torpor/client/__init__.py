"""``torpor.client``: a torpor server's chat API for Python backends (needs the ``client``
extra: ``pip install 'torpor[client]'``, httpx; no Starlette or uvicorn).

>>> async with torpor.client.Client(url, token=tok) as c:
...     turn = await c.send("alice:1", "hello")          # retried with its key on a drop
...     async for item in turn:                          # Delta | torpor.events.Event
...         ...
...     answer = await turn.result()                     # AssistantMessage | Suspended
...     async for item in c.follow("alice:1", after=-1): # resumes from the last id
...         ...

Errors are the runtime's (``torpor.Busy``, ``torpor.UnknownConversation``,
``torpor.TurnAborted``…) as the server names them, plus the HTTP layer's
(:class:`Unauthorized`, :class:`Forbidden`, :class:`Draining`…);
:func:`problem_of` gives the server's whole answer (status, ``Retry-After``).
"""

from torpor.client.follow import Follow
from torpor.client.http import Client, HistoryPage
from torpor.client.items import Delta, Item, Other
from torpor.client.problems import (
    Draining,
    EventTooLong,
    Forbidden,
    HTTPError,
    OwnerUnreachable,
    Problem,
    ServerUnreachable,
    Unauthorized,
    problem_of,
)
from torpor.client.turn import Turn

__all__ = [
    "Client",
    "Delta",
    "Draining",
    "EventTooLong",
    "Follow",
    "Forbidden",
    "HTTPError",
    "HistoryPage",
    "Item",
    "Other",
    "OwnerUnreachable",
    "Problem",
    "ServerUnreachable",
    "Turn",
    "Unauthorized",
    "problem_of",
]
