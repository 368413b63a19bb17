"""Text in and out: the checkpoint's tokenizer.json via `tokenizers` (no Python code from the model)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TokenizerMissingError(FileNotFoundError):
    pass


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerMissingError(f"{path}: not found; pass token ids with --ids instead of --prompt")
    return Tokenizer.from_file(str(path))
