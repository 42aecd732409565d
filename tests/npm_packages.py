"""The npm packages the Node-driven tests use, installed once into a cache folder.

The AI SDK (``ai``) and the MCP reference server (``server-everything``).

``python tests/npm_packages.py`` installs them (``.ci/run`` does, before the tests);
the tests call :func:`ai_sdk` / :func:`mcp_everything` themselves when the cache lacks them.
The folder is ``TORPOR_NPM_CACHE`` (default ``~/.cache/torpor``) / ``<name>-<lockfile hash>``:
``npm ci`` from the committed lockfile, so every run uses the same versions."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

AI_SDK = Path(__file__).parent / "ai_sdk"


class NpmUnavailable(Exception):
    """node or npm is missing, or npm could not install the packages (why: the message)."""


MCP_EVERYTHING = Path(__file__).parent / "mcp_everything"
EVERYTHING_PACKAGE = "@modelcontextprotocol/server-everything"


def _installed(source: Path, prefix: str, package: str) -> Path:
    """``npm ci`` of ``source``'s lockfile into a cache folder named by its hash."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise NpmUnavailable(f"node and npm are needed for the {package} package")
    lock = (source / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("TORPOR_NPM_CACHE") or Path.home() / ".cache" / "torpor")
    folder = cache / f"{prefix}-{hashlib.sha256(lock).hexdigest()[:16]}"
    installed = folder / "node_modules" / package / "package.json"
    if not installed.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(source / name, folder / name)
        try:
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"],
                                  cwd=folder, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NpmUnavailable(f"npm could not install the {package} package: {exc!r}") \
                from None
        if done.returncode != 0 or not installed.is_file():
            raise NpmUnavailable(f"npm could not install the {package} package: "
                                 f"{(done.stderr or done.stdout)[-400:]}")
    return folder


def ai_sdk() -> Path:
    """The folder holding ``node_modules/ai`` and ``chat.mjs`` beside it (ESM resolves
    ``import "ai"`` from the importing file's folder up)."""
    folder = _installed(AI_SDK, "ai-sdk", "ai")
    shutil.copyfile(AI_SDK / "chat.mjs", folder / "chat.mjs")
    return folder


def mcp_everything() -> Path:
    """The entry point of the MCP reference server ``server-everything`` (run it with
    node; its first argument picks the transport: ``stdio``, ``streamableHttp``)."""
    folder = _installed(MCP_EVERYTHING, "mcp-everything", EVERYTHING_PACKAGE)
    return folder / "node_modules" / EVERYTHING_PACKAGE / "dist" / "index.js"


if __name__ == "__main__":
    try:
        print(ai_sdk())
        print(mcp_everything())
    except NpmUnavailable as exc:
        sys.exit(str(exc))
