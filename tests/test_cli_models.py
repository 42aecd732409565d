"""``torpor chat --model`` against the replay server, its one-line errors, and the cache hit
share ``torpor inspect`` shows. Subprocesses, like the other CLI tests: exit codes and
what reaches stdout and stderr are the contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from providers import ANTHROPIC, OPENAI, PROVIDERS, Provider, threaded_server
from replay import Recorded, ReplayServer, Reply

from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.llm import Report, Text

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_BASE_URL", "TORPOR_DEBUG")


def torpor(*args: str, stdin: str = "", env: dict[str, str] | None = None,
           prelude: str = "") -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in KEYS}
    base.update({"PYTHONPATH": str(ROOT), "TORPOR_DB": "sqlite://", "COLUMNS": "120"})
    base.update(env or {})
    code = f"{prelude}\nimport sys\nfrom torpor.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=base, timeout=60, check=False)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torpor: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)
def test_chat_with_a_provider_model(provider: Provider, tmp_path: Path) -> None:
    def reply(request: Recorded) -> Reply:
        return provider.text(["Hi ", "from ", provider.name])

    env = {"ANTHROPIC_API_KEY": "test-key"} if provider is ANTHROPIC else {}
    url = f"sqlite:///{tmp_path / 'chat.db'}"
    with threaded_server(ReplayServer(default=reply)) as server:
        base = f"{server.url}/v1" if provider is OPENAI else server.url
        model = "gpt-test" if provider is OPENAI else "claude-test"
        result = torpor("chat", "--db", url, "--model", f"{provider.name}:{model}",
                        "--base-url", base, stdin="hello\n/quit\n", env=env)
        requests = list(server.requests)
    assert result.returncode == 0, result.stderr
    assert f"torpor> Hi from {provider.name}" in result.stdout
    assert len(requests) == 1
    assert provider.messages(requests[0])[-1]["role"] == "user"
    inspected = torpor("inspect", "--db", url, "chat", "--json", "-")
    assert inspected.returncode == 0, inspected.stderr
    [call] = json.loads(inspected.stdout)["model_calls"]
    assert call["model"] == f"{provider.name}:{model}"


def test_a_missing_key_is_one_line_naming_the_variable() -> None:
    line = one_line_error(torpor("chat", "--model", "anthropic:claude-test", stdin="hi\n"))
    assert "ANTHROPIC_API_KEY" in line
    line = one_line_error(torpor("chat", "--model", "openai:gpt-test", stdin="hi\n"))
    assert "OPENAI_API_KEY" in line and "--base-url" in line


@pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)
def test_a_missing_extra_is_one_line_naming_what_to_install(provider: Provider) -> None:
    blocked = f"import sys; sys.modules[{provider.name!r}] = None  # as if not installed"
    result = torpor("chat", "--model", f"{provider.name}:m", stdin="hi\n", prelude=blocked,
                    env={"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"})
    line = one_line_error(result)
    assert f"pip install 'torpor[{provider.name}]'" in line


def test_a_bad_model_spec_or_a_lone_base_url_is_refused() -> None:
    result = torpor("chat", "--model", "gemini:pro")
    assert result.returncode == 2 and "openai:MODEL or anthropic:MODEL" in result.stderr
    line = one_line_error(torpor("chat", "--base-url", "http://127.0.0.1:9/v1", stdin="hi\n"))
    assert "--base-url needs --model" in line


async def test_inspect_shows_the_cache_hit_share(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    model = ScriptedModel([
        [Text("a"), Report(prompt_tokens=1_000, completion_tokens=5, cache_read_tokens=0,
                           cache_write_tokens=900)],
        [Text("b"), Report(prompt_tokens=1_200, completion_tokens=5, cache_read_tokens=900,
                           cache_write_tokens=250)],
        [Text("c"), Report(prompt_tokens=1_300, completion_tokens=5, cache_read_tokens=1_150,
                           cache_write_tokens=0)],
    ])
    async with Runtime(url, agent=AgentConfig(model=model)) as rt:
        for text in ("one", "two", "three"):
            await (await rt.send("c", text)).result()
    result = torpor("inspect", "--db", url, "c", "--json", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stderr
    assert "prompt cache hit share" in result.stdout and "58.6%" in result.stdout
    cache = json.loads((tmp_path / "out.json").read_text())["prompt_cache"]
    assert cache == {"calls": 3, "calls_reporting_cache": 3, "prompt_tokens": 3_500,
                     "cache_read_tokens": 2_050, "cache_write_tokens": 1_150,
                     "hit_share": 2_050 / 3_500}


def test_chat_reports_a_failed_turn_once() -> None:
    """A model that cannot be reached: the turn's logged abort is shown, once."""
    result = torpor("chat", "--model", "openai:gpt-test", "--base-url", "http://127.0.0.1:9/v1",
                    stdin="hello\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("model_error") == 1, result.stdout
    assert "[aborted]" in result.stdout and "ModelConnectionError" in result.stdout
