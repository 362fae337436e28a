"""What a terminal shows for bytes written to it, for tests of progress output.

``\\r`` returns to column 0 and later text overwrites, ``ESC[K`` erases to the end of the
line, other escape sequences are dropped: enough to see whether a message was written
on a line of its own or glued to a progress bar's text.
"""

from __future__ import annotations

import re

__all__ = ["screen"]

_TOKEN = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r|[^\x1b\r]")


def screen(raw: str) -> list[str]:
    """The lines a terminal would show for ``raw``, trailing blanks stripped."""
    lines: list[str] = []
    for text in raw.split("\n"):
        line: list[str] = []
        col = 0
        for token in _TOKEN.findall(text):
            if token == "\r":
                col = 0
            elif token == "\x1b[K":
                del line[col:]
            elif token.startswith("\x1b"):
                continue
            else:
                if col < len(line):
                    line[col] = token
                else:
                    line.extend(" " * (col - len(line)))
                    line.append(token)
                col += 1
        lines.append("".join(line).rstrip())
    return lines
