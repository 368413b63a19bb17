"""JSON text decoded only when its nesting stays within a bound.

``json.loads`` recurses once per nested array or object, so text nested ~1000 deep (a model's tool-call
arguments, a client's arguments string) raises RecursionError, an error no caller expects. A linear
pre-scan counts the nesting first (brackets outside strings; no recursion, no decoding) and text nested
deeper than ``MAX_DEPTH`` is refused as not JSON, the way bad JSON is.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # deeper than any tool's arguments; far below the interpreter's recursion limit

# A string (its closing quote optional, so an unterminated one ends the scan) or one bracket. The string
# is the unrolled loop "[^"\\]*(\\.[^"\\]*)*", which matches in one pass (no backtracking).
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)


class TooDeep(ValueError):
    """JSON text nested deeper than the bound (a ValueError, as bad JSON is)."""


def deeper_than(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether ``text``'s arrays and objects nest more than ``limit`` deep (brackets inside strings do
    not count; text that is no JSON still gets an answer). One pass, stopping at the first bracket too deep."""
    if text.count("[") + text.count("{") <= limit:  # too few openers to be deeper: no scan
        return False
    depth = 0
    for token in _TOKEN.finditer(text):
        char = text[token.start()]
        if char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth = max(depth - 1, 0)
    return False


def loads(text: str | bytes, limit: int = MAX_DEPTH, **options: Any) -> Any:
    """``json.loads`` for text nested at most ``limit`` deep; TooDeep (a ValueError) otherwise."""
    probe = text if isinstance(text, str) else text.decode("utf-8", "replace")
    if deeper_than(probe, limit):
        raise TooDeep(f"JSON nested more than {limit} deep")
    return json.loads(text, **options)
