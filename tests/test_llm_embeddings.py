"""OpenAIEmbedder against a loopback server, through the official openai SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from replay import ReplayServer, json_reply, openai_error

import torpor
from torpor.llm import OpenAIEmbedder


@pytest.fixture
async def server() -> AsyncIterator[ReplayServer]:
    async with ReplayServer() as running:
        yield running


def embedder(server: ReplayServer, **options: object) -> OpenAIEmbedder:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
    return OpenAIEmbedder(client, model="embed-test", dimensions=3, **options)  # type: ignore[arg-type]


def vectors_reply(vectors: list[list[float]], order: list[int] | None = None) -> object:
    indexes = order if order is not None else list(range(len(vectors)))
    data = [{"object": "embedding", "index": i, "embedding": vectors[i]} for i in indexes]
    return json_reply(200, {"object": "list", "data": data, "model": "embed-test",
                            "usage": {"prompt_tokens": 3, "total_tokens": 3}})


async def test_texts_go_out_in_one_request_and_vectors_come_back_in_input_order(
    server: ReplayServer,
) -> None:
    server.add(vectors_reply([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], order=[1, 0]))  # type: ignore[arg-type]
    e = embedder(server, shorten=True)
    assert await e.embed(["first", "second"]) == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    (request,) = server.requests
    assert request.path == "/v1/embeddings"
    body = request.json()
    assert body["input"] == ["first", "second"] and body["model"] == "embed-test"
    assert body["dimensions"] == 3  # shorten: the server is asked for 3
    assert e.name == "openai:embed-test"


async def test_a_wrong_size_vector_is_a_response_error(server: ReplayServer) -> None:
    server.add(vectors_reply([[1.0, 0.0]]))  # type: ignore[arg-type]
    with pytest.raises(torpor.ModelResponseError, match="3 floats"):
        await embedder(server).embed(["x"])
    assert "dimensions" not in json.loads(server.requests[0].body)


async def test_provider_errors_are_torpors(server: ReplayServer) -> None:
    server.add(openai_error(429, "slow down", kind="rate_limit_error"))
    with pytest.raises(torpor.ModelRateLimited):
        await embedder(server).embed(["x"])


async def test_a_runtime_embeds_through_the_endpoint(server: ReplayServer) -> None:
    server.default = lambda request: vectors_reply(  # type: ignore[assignment,return-value]
        [[1.0, float(i), 0.0] for i in range(len(request.json()["input"]))]
    )
    config = torpor.RuntimeConfig(embedder=embedder(server), embed_interval=3600)
    async with torpor.Runtime(config=config) as rt:
        await (await rt.send("c", "hello there")).result()
        stats = await rt.admin.embed()
        assert stats is not None and stats.embedded == 2 and stats.space == "openai:embed-test/3"
        hits = await rt.recall("c", "unrelated words", 2)
        assert {h.position for h in hits} == {0, 1}
