"""One hierarchy for user-facing failures: the CLI prints any of them as one line (exit status 1);
anything else is a bug and gets a traceback (exit status 3).

    ColibriError                 (this package)
      CheckpointError            a Hugging Face checkpoint directory: config.json, shards, tensors
      BudgetError                a budget that cannot work (also a storage.errors.BudgetError)
      SessionError               a session name or state that cannot be used
        SessionInUseError        held by another process (also a storage IncompatibleStateError)
      TokenizerError             tokenizer.json missing or unusable
        ChatTemplateError        a chat template that fails to render in the sandbox
      RequestError               a prompt or sampling request that cannot be served
    storage.errors.StorageError  containers, KV logs, usage histories (FormatError, CorruptDataError,
                                 IncompatibleStateError, BudgetError), SettingError (its environment knob)
    engine.config.args.ConfigError      a config.json whose semantics the engine does not implement
    engine.config.weights.WeightNameError  tensors that do not map onto the engine's weights

engine and storage cannot import this module (they never import the library), so their bases are
listed here instead of derived from ColibriError; ``USER_ERRORS`` is the tuple to catch.
"""

from __future__ import annotations

from engine.config.args import ConfigError
from engine.config.weights import WeightNameError
from storage import errors as storage_errors


class ColibriError(Exception):
    """Base of every user-facing error the library raises; the message names the file, key or flag."""


class CheckpointError(ColibriError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


class BudgetError(ColibriError, storage_errors.BudgetError):
    """A budget file, flag or size that cannot work; the message names the key and the numbers.
    Also a storage BudgetError, so one ``except`` catches the store's refusals and the planner's."""


class SessionError(ColibriError):
    """A session name or conversation state that cannot be used."""


class SessionInUseError(SessionError, storage_errors.IncompatibleStateError):
    """A session another process holds; the message names its pid. Also a storage error, so the server
    answers it as it answers a KV log locked elsewhere (409)."""


class TokenizerError(ColibriError):
    """A tokenizer that is missing or cannot be used; the message names the file."""


class ChatTemplateError(TokenizerError):
    """A chat template that fails to render (in the sandbox)."""


class RequestError(ColibriError):
    """A prompt, sampling parameter or length that cannot be served."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ColibriError,
    storage_errors.StorageError,
    ConfigError,
    WeightNameError,
)
