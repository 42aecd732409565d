"""Telling the world a turn was aborted: one log record and the observers, once per turn.

Every site that logs an ``Aborted`` for a turn (the turn's own end, a drain ending
postponed turns, revival finding a turn the process died in, the admission queue
closing) calls :func:`report_abort` once it is in the log, so log records and
metrics count each aborted turn exactly once, whichever path ended it.

Level: a cancel is the caller's choice, not a failure (info); every other abort
lost a user an answer (warning), a shutdown's too (the grace was too short for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torpor.actors.observe import AbortInfo
from torpor.errors import TurnAborted
from torpor.events import Aborted, abort_fields_of

if TYPE_CHECKING:
    from torpor.actors.observe import Observers

__all__ = ["report_abort", "turn_aborted"]


def turn_aborted(body: Aborted, error: BaseException | None = None) -> TurnAborted:
    """What a caller of the turn ``body`` ended gets (replayed: ``error`` None)."""
    return TurnAborted(body.reason, body.partial_text, body.detail, error,
                       fields=abort_fields_of(body))


def report_abort(
    log: Any,
    observers: Observers,
    conversation_id: str,
    turn: int,
    body: Aborted,
    error: BaseException | None = None,
) -> None:
    """Log the abort (``turn_aborted``) and tell the observers."""
    fields = abort_fields_of(body)
    record = log.info if body.reason == "cancelled" else log.warning
    record("turn_aborted", conversation_id=conversation_id, turn=turn, reason=body.reason,
           error=fields.error, status=fields.status, retryable=fields.retryable,
           retry_after=fields.retry_after, detail=body.detail)
    if observers:
        observers.aborted(AbortInfo(
            conversation_id, turn, body.reason, body.detail, error, error_type=fields.error,
            retryable=fields.retryable, retry_after=fields.retry_after, status=fields.status,
            message=fields.message,
        ))
