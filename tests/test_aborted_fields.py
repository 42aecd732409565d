"""The structured fields of an abort (issue 22): logged with the ``Aborted`` event, read
back the same on both backends, refused when unsound, and absent from rows written
before they existed, which still decode."""

from __future__ import annotations

import msgspec
import pytest
from store_backends import Backend

from torpor import InvalidInput, ModelRateLimited, TurnAborted
from torpor.errors import MODEL_ERROR_MESSAGES, AbortFields, abort_fields
from torpor.events import Aborted, Event, UserMessage, abort_fields_of, aborted_body, decode_body
from torpor.serve.sse import event_data


class _OldAborted(msgspec.Struct, tag="aborted", omit_defaults=True):
    """The body as rows were written before the structured fields."""

    reason: str
    partial_text: str = ""
    detail: str = ""


def test_a_rate_limit_becomes_fixed_fields_and_never_the_providers_text() -> None:
    error = ModelRateLimited("LiteLLM: model group 'mock-429' failed, see https://x.example/",
                             provider="openai", status=429, retry_after=3.0)
    body = aborted_body("model_error", "par", f"ModelRateLimited: {error}", error)
    assert abort_fields_of(body) == AbortFields(
        "ModelRateLimited", True, 3.0, 429,
        "The model provider is rate limiting requests; try again in a moment.")
    assert "LiteLLM" in body.detail and "LiteLLM" not in body.message
    quota = ModelRateLimited("insufficient_quota", status=429)
    quota.retryable = False
    spent = abort_fields("model_error", quota)
    assert not spent.retryable and "quota" in spent.message


def test_a_subclass_of_a_model_error_is_named_as_torpors_own() -> None:
    class Throttled(ModelRateLimited):
        pass

    fields = abort_fields("model_error", Throttled("slow", status=429))
    assert fields.error == "ModelRateLimited"
    odd = abort_fields("model_error", ModelRateLimited("x", status=7, retry_after=-1))
    assert odd.status is None and odd.retry_after is None  # what the log can hold


def test_turn_aborted_exposes_the_same_fields() -> None:
    error = ModelRateLimited("slow down", status=429, retry_after=2.0)
    aborted = TurnAborted("model_error", "", "detail", error)
    assert (aborted.error_type, aborted.retryable, aborted.retry_after, aborted.status) == (
        "ModelRateLimited", True, 2.0, 429)
    assert aborted.error is error and aborted.__cause__ is error  # as before
    assert aborted.message == MODEL_ERROR_MESSAGES["ModelRateLimited"]
    cancelled = TurnAborted("cancelled")
    assert (cancelled.error_type, cancelled.retryable) == (None, False)
    assert TurnAborted("step_limit").error_type == "StepLimit"
    assert TurnAborted("shutdown").retryable and TurnAborted("interrupted").retryable


def test_an_old_row_decodes_and_reads_as_its_reason_implies() -> None:
    old = msgspec.msgpack.encode(_OldAborted("model_error", "half", "ModelTimeout: …"))
    body = decode_body(old, conversation_id="c", position=3)
    assert isinstance(body, Aborted) and body.message == "" and body.error is None
    assert abort_fields_of(body) == abort_fields("model_error")
    data = event_data(Event("c", 3, 1, 0, 0, body))["body"]
    assert data["error"] == "ModelError" and data["retryable"] is False
    assert data["message"] == MODEL_ERROR_MESSAGES["ModelError"]
    # the fields cost an old-style abort nothing: a row with none set is the old row
    assert msgspec.msgpack.encode(Aborted("model_error", "half", "ModelTimeout: …")) == old


async def test_the_fields_are_stored_and_read_back_and_unsound_ones_refused(
    backend: Backend,
) -> None:
    error = ModelRateLimited("no", status=429, retry_after=1.5)
    body = aborted_body("model_error", "", "no", error)
    async with backend.open() as store:
        await store.append("c", [UserMessage("hi")])
        await store.append("c", [body])
        (_, read) = await store.read_since("c", 0)
        assert read.body == body
        for bad in ({"status": 99}, {"retry_after": float("nan")}, {"error": "a\nb"},
                    {"retryable": 1}):
            with pytest.raises(InvalidInput):
                await store.append("c", [msgspec.structs.replace(body, **bad)])
