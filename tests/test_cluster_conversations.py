"""Conversations as owned data on a cluster (real PostgreSQL, two in-process nodes).

A DELETE through a node that does not own the conversation is proxied to the owner;
listing reads the shared store on any node; a retention pass on a node deletes only the
conversations of the shards it serves.
"""

from __future__ import annotations

from typing import Any

import pytest

from torpor.llm.echo import EchoModel

asyncpg = pytest.importorskip("asyncpg")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_cluster_proxy import AUTH, node, owned_by, split  # noqa: E402

from torpor.serve.proxy import OWNER_HEADER  # noqa: E402

DAY_MS = 86_400_000


@pytest.fixture
def db(pg_url: str) -> str:
    return pg_url


async def _send(client: Any, url: str, cid: str) -> None:
    response = await client.post(f"{url}/v1/conversations/{cid}/messages",
                                 headers={**AUTH, "Accept": "application/json"},
                                 json={"text": f"hello {cid}"})
    assert response.status_code == 202, response.text


async def test_delete_is_proxied_to_the_owner_and_retention_keeps_to_its_shards(
    db: str,
) -> None:
    model = EchoModel()
    async with node(db, "a", model) as a, node(db, "b", model) as b:
        held = await split(a, b)
        on_a = [owned_by(held["a"], p) for p in ("x", "y")]
        on_b = [owned_by(held["b"], p) for p in ("x", "y")]
        async with httpx.AsyncClient(timeout=20) as client:
            for cid in on_a:
                await _send(client, a.url, cid)
            for cid in on_b:
                await _send(client, b.url, cid)
            listed = await client.get(f"{b.url}/v1/conversations?limit=100", headers=AUTH)
            assert sorted(c["id"] for c in listed.json()["conversations"]) == sorted(
                on_a + on_b)  # the shared store, whichever node answers

            gone = await client.delete(f"{b.url}/v1/conversations/{on_a[0]}", headers=AUTH)
            assert gone.status_code == 204, gone.text
            assert gone.headers[OWNER_HEADER] == a.url.removeprefix("http://")
            again = await client.delete(f"{b.url}/v1/conversations/{on_a[0]}", headers=AUTH)
            assert again.status_code == 404
        assert await a.rt.store.head(on_a[0]) is None

        conn = await asyncpg.connect(db)
        try:
            await conn.execute("UPDATE conversations SET updated_at = updated_at - $1",
                               2 * DAY_MS)
        finally:
            await conn.close()
        assert await b.rt.expire(86_400) == 2  # its own two, not a's
        left = sorted(i.id for i in await a.rt.conversations())
        assert left == [on_a[1]]
        assert await a.rt.expire(86_400) == 1
        audit = await a.rt.store.deletions()
        assert sorted(d.by for d in audit) == ["delete", "retention", "retention", "retention"]
