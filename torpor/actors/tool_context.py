"""What a local tool may know about the call it answers: :class:`ToolContext`.

A tool that declares a parameter annotated ``ToolContext`` gets one per call
(the parameter is not part of the schema the model sees, and a model that
names it in its arguments gets an error result, never a say in it). Made by
:mod:`torpor.actors.turn_context`, only for the tools that ask for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

__all__ = ["EMPTY_METADATA", "ToolContext"]

EMPTY_METADATA: Mapping[str, Any] = MappingProxyType({})


class ToolContext(msgspec.Struct, frozen=True, kw_only=True):
    """The call a local tool answers: declare a parameter annotated ``ToolContext`` to get it.

    ``metadata``: what the host passed with the turn's user message
    (``Runtime.send(..., metadata=)``, or the HTTP ``authorize`` hook), read-only;
    empty when none was given. It is that of the message that started the turn, also
    when the turn ran postponed, continued after an approval or after a restart.
    """

    conversation_id: str
    turn: int
    call_id: str
    tool_name: str
    metadata: Mapping[str, Any] = EMPTY_METADATA
