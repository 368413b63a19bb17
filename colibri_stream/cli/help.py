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


# Every command's last exit status (colibri_stream.cli.EXIT_INTERNAL_ERROR), said once here.
INTERNAL_ERROR_STATUS = "exit status 3 on an internal error: a bug, not your input (the traceback is printed)."


def help_options(epilog: str) -> dict:
    """Keyword arguments for ``add_parser``: the epilog (with the internal-error status every command
    shares) and the formatter that keeps it intact."""
    return {"epilog": f"{epilog}\n{INTERNAL_ERROR_STATUS}", "formatter_class": ExamplesFormatter}
