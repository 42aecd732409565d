"""The npm packages the Node-driven tests use, installed once into a cache folder.

``python tests/npm_packages.py`` installs them (``.ci/run`` does, before the tests);
the tests call :func:`ai_sdk` themselves when the cache lacks them. The folder is
``TORPOR_NPM_CACHE`` (default ``~/.cache/torpor``) / ``ai-sdk-<lockfile hash>``:
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


def ai_sdk() -> Path:
    """The folder holding ``node_modules/ai`` and ``chat.mjs`` beside it (ESM resolves
    ``import "ai"`` from the importing file's folder up)."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise NpmUnavailable("node and npm are needed for the AI SDK client")
    lock = (AI_SDK / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("TORPOR_NPM_CACHE") or Path.home() / ".cache" / "torpor")
    folder = cache / f"ai-sdk-{hashlib.sha256(lock).hexdigest()[:16]}"
    installed = folder / "node_modules" / "ai" / "package.json"
    if not installed.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(AI_SDK / name, folder / name)
        try:
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"],
                                  cwd=folder, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NpmUnavailable(f"npm could not install the ai package: {exc!r}") from None
        if done.returncode != 0 or not installed.is_file():
            raise NpmUnavailable(f"npm could not install the ai package: "
                                 f"{(done.stderr or done.stdout)[-400:]}")
    shutil.copyfile(AI_SDK / "chat.mjs", folder / "chat.mjs")
    return folder


if __name__ == "__main__":
    try:
        print(ai_sdk())
    except NpmUnavailable as exc:
        sys.exit(str(exc))
