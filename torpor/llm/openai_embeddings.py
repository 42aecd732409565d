"""OpenAIEmbedder: an :class:`~torpor.llm.embedding.Embedder` over the official ``openai`` SDK.

``client.embeddings.create`` is what every OpenAI-compatible server answers
(OpenAI, vLLM, llama.cpp server, Ollama, LiteLLM's proxy): point the client's
``base_url`` at it. Errors become torpor's typed model errors, as for chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torpor.errors import ConfigError
from torpor.llm.embedding import check_vectors
from torpor.llm.openai_chat import _api_error
from torpor.llm.provider_errors import is_transport_error, transport_error

if TYPE_CHECKING:
    import openai

__all__ = ["OpenAIEmbedder"]

MAX_BATCH = 256  # texts per request: well under every server's input-array limit


class OpenAIEmbedder:
    """Embeds through ``client.embeddings.create(model=..., input=[...])``.

    ``dimensions``: the size of the model's vectors. ``shorten``: also send
    ``dimensions=`` in the request (models that can shorten their vectors, such as
    ``text-embedding-3-*``; other servers may refuse the field). ``name``: the
    vector space's name (default ``openai:MODEL``); change it when the model behind
    the same name changes, so old vectors are not compared with new ones.
    """

    provider = "openai"

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        model: str,
        dimensions: int,
        shorten: bool = False,
        name: str | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ConfigError("model", f"must be a non-empty model name, got {model!r}")
        if type(dimensions) is not int or not 1 <= dimensions <= 65_536:
            raise ConfigError("dimensions", f"must be an int from 1 to 65536, got {dimensions!r}")
        self.client = client
        self.model = model
        self.dimensions = dimensions
        self.shorten = shorten
        self.name = name if name is not None else f"openai:{model}"

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(texts), MAX_BATCH):
            out.extend(await self._batch(texts[start : start + MAX_BATCH]))
        return out

    async def _batch(self, texts: Sequence[str]) -> list[list[float]]:
        params: dict[str, Any] = {"model": self.model, "input": list(texts)}
        if self.shorten:
            params["dimensions"] = self.dimensions
        try:
            response = await self.client.embeddings.create(**params)
        except Exception as exc:
            mapped = _api_error(self.provider, exc)
            if mapped is None and is_transport_error(exc):
                mapped = transport_error(self.provider, exc)
            if mapped is None:
                raise
            raise mapped from exc
        # The API promises input order, but each item carries its index: trust that.
        ordered = sorted(response.data, key=lambda item: item.index)
        return check_vectors(self, texts, [list(item.embedding) for item in ordered])

    def __repr__(self) -> str:
        return f"OpenAIEmbedder(model={self.model!r}, dimensions={self.dimensions})"
