"""``--model openai:MODEL`` / ``anthropic:MODEL``: a provider adapter for the command line.

Keys come from the usual environment variables (``OPENAI_API_KEY``,
``ANTHROPIC_API_KEY`` or ``ANTHROPIC_AUTH_TOKEN``). With ``--base-url`` an
OpenAI-compatible local server (vLLM, llama.cpp, Ollama, LM Studio) needs no
key. A missing extra or key is one line naming what to install or set.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from torpor.cli.common import CliError
from torpor.llm.protocol import Model

__all__ = ["PROVIDERS", "ModelSpec", "build_model", "model_spec"]

PROVIDERS = ("openai", "anthropic")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    provider: str
    model: str


def model_spec(text: str) -> ModelSpec:
    """``openai:gpt-4o-mini`` or ``anthropic:claude-sonnet-4-5`` (argparse type)."""
    provider, sep, model = text.partition(":")
    provider = provider.strip().lower()
    if not sep or provider not in PROVIDERS or not model.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected openai:MODEL or anthropic:MODEL (e.g. openai:gpt-4o-mini)"
        )
    return ModelSpec(provider, model.strip())


def _missing(provider: str) -> CliError:
    return CliError(
        f"--model {provider}:… needs the {provider} extra: pip install 'torpor[{provider}]'"
    )


def build_model(spec: ModelSpec, base_url: str | None, *, max_output_tokens: int) -> Model:
    """The adapter for ``spec``, its SDK client built from the environment."""
    if spec.provider == "openai":
        try:
            import openai
        except ImportError:
            raise _missing("openai") from None
        from torpor.llm.openai_chat import OpenAIChatModel

        key = os.environ.get("OPENAI_API_KEY")
        if not key and base_url is None:
            raise CliError("--model openai:… needs OPENAI_API_KEY set (or --base-url URL for "
                           "a local OpenAI-compatible server)")
        client = openai.AsyncOpenAI(api_key=key or "not-needed", base_url=base_url)
        return OpenAIChatModel(client, model=spec.model)
    try:
        import anthropic
    except ImportError:
        raise _missing("anthropic") from None
    from torpor.llm.anthropic_messages import AnthropicModel

    key = os.environ.get("ANTHROPIC_API_KEY")
    token = os.environ.get("ANTHROPIC_AUTH_TOKEN")
    if not key and not token:
        raise CliError("--model anthropic:… needs ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) set")
    aclient = anthropic.AsyncAnthropic(
        api_key=key or None, auth_token=None if key else token, base_url=base_url
    )
    return AnthropicModel(aclient, model=spec.model, max_tokens=max_output_tokens)
