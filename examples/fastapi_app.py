"""A FastAPI app serving torpor's chat API under /chat, a token per user."""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import torpor
import torpor.serve

# Your agent: system prompt, tools (see Use). Without a model the runtime answers with its
# local echo model; pass model= for a real one (see Real models).
agent = torpor.AgentConfig(system_prompt="Be brief.", tools=[])
rt = torpor.Runtime(os.environ.get("CHAT_DB", "sqlite:///chat.db"), agent=agent)

# A bearer token per user (load them from your secrets): alice may read and write the
# conversations "alice" and "alice:…", bob "bob" and "bob:…", and nothing else.
users = torpor.serve.bearer_tokens({
    os.environ.get("ALICE_TOKEN", "alice-token"): "alice",
    os.environ.get("BOB_TOKEN", "bob-token"): "bob",
})
chat = torpor.serve.app(rt, authorize=users, admin_token=os.environ.get("ADMIN_TOKEN"))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with rt:  # the runtime runs while the app serves; the mounted app needs no more
        yield


app = FastAPI(lifespan=lifespan)
app.mount("/chat", chat)  # POST /chat/v1/conversations/alice/messages {"text": "hi"}


@app.get("/")
async def index() -> dict[str, str]:
    return {"chat": "/chat/v1/conversations/{conversation_id}/messages"}
