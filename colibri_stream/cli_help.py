"""Help output shared by every command: wrapped descriptions, examples kept exactly as written."""

from __future__ import annotations

import argparse


class ExamplesFormatter(argparse.HelpFormatter):
    """One-paragraph descriptions are wrapped to the terminal as usual; multi-line text (the epilog
    with examples and exit statuses) is printed as written, so command lines stay copy-pasteable."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def help_options(epilog: str) -> dict:
    """Keyword arguments for ``add_parser``: the epilog and the formatter that keeps it intact."""
    return {"epilog": epilog, "formatter_class": ExamplesFormatter}
