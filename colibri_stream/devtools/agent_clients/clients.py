"""The real coding agents `tools/agent_clients.py` runs against `serve`: where each comes from, how it is
installed into the cache, and the command line + environment of each of its two turns, configured with
nothing but the server's base URL and an API key (plus switches that keep it off the internet).

What each needs, as found with these versions (the least that works; nothing else is configured):
- Claude Code: ANTHROPIC_BASE_URL + ANTHROPIC_API_KEY, `claude -p PROMPT`, then `claude -p --continue`.
- Codex CLI: OPENAI_BASE_URL is NOT read (0.171.0 goes to api.openai.com and waits for the network for
  ever) and OPENAI_API_KEY is not sent by its built-in provider; the least is CODEX_API_KEY=KEY plus
  `-c openai_base_url="URL/v1"`. It first tries a WebSocket upgrade on GET /v1/responses (5 tries, about
  6 s) and falls back to HTTP POST. `codex exec`, then `codex exec resume --last`.
- OpenCode: a provider entry in OPENCODE_CONFIG_CONTENT (`@ai-sdk/openai-compatible`, baseURL, apiKey,
  one model: OpenCode has no base-URL variable), `opencode run`, then `opencode run --continue`.
- Aider: --openai-api-base, --openai-api-key, --model openai/NAME, --message; the second turn adds
  --restore-chat-history (its history file is in the working directory).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NPM_PACKAGES = {  # package -> exact version (the versions, or the newest the registry gives)
    "@anthropic-ai/claude-code": "2.1.197",
    "@openai/codex": "0.171.0",
    "opencode-ai": "1.18.33",
}
PIP_PACKAGES = {"aider-chat": "0.86.2"}
INSTALL_TIMEOUT_S = 1800
QUIET_ENV = {  # telemetry, error reports and update checks off, everywhere they are asked
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # Aider's litellm: no price list from GitHub
    "NO_COLOR": "1",
}


@dataclass(frozen=True)
class Target:
    """Where a client is pointed: the server's origin (http://host:port, no /v1), its key and model."""

    origin: str
    key: str
    model: str


@dataclass(frozen=True)
class Turn:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Client:
    name: str  # the table's
    label: str  # fixture and folder names
    version_argv: Callable[[Path], list[str]]  # (cache dir) -> the command printing its version
    turn: Callable[[Path, Target, int, str], Turn]  # (cache dir, target, turn 1 or 2, prompt)


def npm_bin(cache: Path, name: str) -> str:
    return str(cache / "npm" / "node_modules" / ".bin" / name)


def aider_bin(cache: Path) -> str:
    return str(cache / "aider-venv" / "bin" / "aider")


def _claude(cache: Path, target: Target, turn: int, prompt: str) -> Turn:
    argv = [npm_bin(cache, "claude"), "-p", *(["--continue"] if turn > 1 else []), prompt]
    return Turn(argv, {"ANTHROPIC_BASE_URL": target.origin, "ANTHROPIC_API_KEY": target.key})


def _codex(cache: Path, target: Target, turn: int, prompt: str) -> Turn:
    base = ["-c", f'openai_base_url="{target.origin}/v1"', "-c", "analytics.enabled=false"]
    argv = [npm_bin(cache, "codex"), "exec", "--skip-git-repo-check", *base]
    argv += ["resume", "--last", prompt] if turn > 1 else [prompt]
    return Turn(argv, {"CODEX_API_KEY": target.key})


def _opencode(cache: Path, target: Target, turn: int, prompt: str) -> Turn:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "colibri",
        "options": {"baseURL": f"{target.origin}/v1", "apiKey": target.key},
        "models": {target.model: {"name": target.model}},
    }
    config = {"provider": {"colibri": provider}, "model": f"colibri/{target.model}", "share": "disabled"}
    argv = [npm_bin(cache, "opencode"), "run", *(["--continue"] if turn > 1 else []), prompt]
    return Turn(argv, {"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


def _aider(cache: Path, target: Target, turn: int, prompt: str) -> Turn:
    argv = [aider_bin(cache), "--openai-api-base", f"{target.origin}/v1", "--openai-api-key", target.key]
    argv += ["--model", f"openai/{target.model}", "--message", prompt, "--yes-always", "--no-git"]
    # off the internet and out of prompts: no update check, no analytics, no "open the docs?" question
    argv += ["--no-check-update", "--analytics-disable", "--no-show-model-warnings", "--no-pretty"]
    argv += ["--restore-chat-history"] if turn > 1 else []
    return Turn([*argv, "hello.py"], {})


CLIENTS = (
    Client("Claude Code", "claude_code", lambda c: [npm_bin(c, "claude"), "--version"], _claude),
    Client("Codex CLI", "codex", lambda c: [npm_bin(c, "codex"), "--version"], _codex),
    Client("OpenCode", "opencode", lambda c: [npm_bin(c, "opencode"), "--version"], _opencode),
    Client("Aider", "aider", lambda c: [aider_bin(c), "--version"], _aider),
)


def _npm_installed(cache: Path) -> bool:
    for package, version in NPM_PACKAGES.items():
        manifest = cache / "npm" / "node_modules" / package / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return True


def install(cache: Path, log: Callable[[str], None]) -> None:
    """npm packages into CACHE/npm, aider-chat into the venv CACHE/aider-venv; skipped when present."""
    if not _npm_installed(cache):
        (cache / "npm").mkdir(parents=True, exist_ok=True)
        specs = [f"{package}@{version}" for package, version in NPM_PACKAGES.items()]
        log(f"npm install {' '.join(specs)}")
        npm = ["npm", "install", "--prefix", str(cache / "npm"), "--no-audit", "--no-fund", "--loglevel=error"]
        subprocess.run([*npm, *specs], check=True, timeout=INSTALL_TIMEOUT_S)
    venv = cache / "aider-venv"
    specs = [f"{package}=={version}" for package, version in PIP_PACKAGES.items()]
    if not (venv / "bin" / "aider").is_file():
        log(f"python -m venv {venv}; pip install {' '.join(specs)}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *specs]
        subprocess.run(pip, check=True, timeout=INSTALL_TIMEOUT_S)
