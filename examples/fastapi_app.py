"""A FastAPI app serving torpor's chat API under /chat, a token per user."""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import torpor
import torpor.serve

ORDERS = {"17": ("alice", "shipped"), "18": ("bob", "packed")}  # your own data


@torpor.tool
async def order_status(order_id: str, ctx: torpor.ToolContext) -> str:
    """Where one of the caller's orders is."""
    owner, status = ORDERS.get(order_id, (None, ""))
    if owner != ctx.metadata.get("user"):  # the authenticated user, set by the server
        return "no such order"
    return f"order {order_id}: {status}"


# Your model: any OpenAI-compatible server (OpenAI, a LiteLLM proxy, vLLM, Ollama) when
# OPENAI_API_KEY is set (the client reads OPENAI_BASE_URL too); else the local echo model.
model = None
if os.environ.get("OPENAI_API_KEY"):
    import openai

    from torpor.llm.openai_chat import OpenAIChatModel

    model = OpenAIChatModel(openai.AsyncOpenAI(), model=os.environ.get("MODEL", "gpt-4o-mini"))

agent = torpor.AgentConfig(system_prompt="Be brief.", tools=[order_status])
rt = torpor.Runtime(os.environ.get("CHAT_DB", "sqlite:///chat.db"), model=model, agent=agent)

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
