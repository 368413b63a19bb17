"""The real coding agents (Claude Code, Codex CLI, OpenCode, Aider) installed and run against `serve`."""
