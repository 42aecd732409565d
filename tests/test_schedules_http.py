"""Schedules over real HTTP (serve.schedules): add, list and cancel under the conversation,
each behind ``authorize`` (another user's conversation is 403 and nothing changes), and
every conversation's schedules on the admin (behind its token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_support import ADMIN, served

from torpor import Runtime
from torpor.serve import bearer_tokens
from torpor.serve.client import Client, HTTPStatusError


def _users() -> Any:
    return bearer_tokens({"tok-a": "alice", "tok-b": "bob"})


async def test_add_list_cancel_with_authorize_and_admin(tmp_path: Path) -> None:
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt, served(
        rt, authorize=_users()
    ) as (url, _client, _app):
        alice, bob = Client(url, "tok-a"), Client(url, "tok-b")
        await alice.send("alice", "hello")
        path = "/v1/conversations/alice/schedules"
        added = await alice.call("POST", path, json_body={"text": "stand-up", "after": 3600,
                                                          "key": "daily"}, expect=(201,))
        assert added["text"] == "stand-up" and added["conversation_id"] == "alice"
        assert added["due"] > 0 and added["every"] is None
        again = await alice.call("POST", path, json_body={"text": "stand-up", "after": 3600,
                                                          "key": "daily"}, expect=(201,))
        assert again["id"] == added["id"]  # idempotent by key
        with pytest.raises(HTTPStatusError) as conflict:
            await alice.call("POST", path, json_body={"text": "other", "after": 1,
                                                      "key": "daily"}, expect=(201,))
        assert conflict.value.status == 409
        with pytest.raises(HTTPStatusError) as bad:
            await alice.call("POST", path, json_body={"text": "x", "after": 1, "every": 0.01},
                             expect=(201,))
        assert bad.value.status == 422
        with pytest.raises(HTTPStatusError) as unknown:
            await alice.call("POST", path, json_body={"text": "x", "in": 1}, expect=(201,))
        assert unknown.value.status == 422
        for method, where, body in (("POST", path, {"text": "x", "after": 1}),
                                    ("GET", path, None),
                                    ("DELETE", f"{path}/{added['id']}", None)):
            with pytest.raises(HTTPStatusError) as denied:
                await bob.call(method, where, json_body=body, expect=(200, 201, 204))
            assert denied.value.status == 403
        listed = await alice.call("GET", path)
        assert [s["id"] for s in listed["schedules"]] == [added["id"]]
        admin = Client(url, ADMIN)
        page = await admin.call("GET", "/admin/schedules?limit=10")
        assert [s["id"] for s in page["schedules"]] == [added["id"]] and page["next"] is None
        await alice.call("DELETE", f"{path}/{added['id']}", expect=(204,))
        with pytest.raises(HTTPStatusError) as gone:
            await alice.call("DELETE", f"{path}/{added['id']}", expect=(204,))
        assert gone.value.status == 404
        assert (await alice.call("GET", path))["schedules"] == []
        assert await rt.schedules("alice") == []
