"""MkDocs hook: the CLI reference, each command's ``--help`` as ``rollflow`` prints it, at build time.

Owns: the help blocks of ``docs/reference/cli.md``. The page holds the prose and one marker
``<!-- cli-help COMMAND -->`` per command; this hook replaces each marker with the output of
``rollflow COMMAND --help`` (``rollflow.cli.main``, in this process: argparse prints and exits),
so the page follows cli.py. A marker naming a command the CLI does not have fails the build.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any

PAGE = "reference/cli.md"
MARKER = re.compile(r"<!-- cli-help ?([a-z-]*) -->")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace every help marker of the CLI page with that command's help."""
    if page.file.src_uri != PAGE:
        return markdown
    return MARKER.sub(lambda m: "```text\n" + cli_help(m.group(1)).rstrip() + "\n```", markdown)


def cli_help(command: str) -> str:
    """``rollflow [COMMAND] --help``, 100 columns wide; an unknown command is an error."""
    from rollflow.cli import main

    argv = [command, "--help"] if command else ["--help"]
    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ValueError(
                f"rollflow {command} --help failed: {err.getvalue().strip()}"
            ) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()
