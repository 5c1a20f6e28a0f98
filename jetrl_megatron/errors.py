"""The one exception type for mistakes a user can fix (a bad recipe, a missing path, the wrong launcher).

Why a shared base class: the CLI turns it into one ``jetrl <cmd>: <message>`` line and exit status 2 instead of a
multi-line traceback, so every such message must name what to change (key, path, size, allowed range) on one line.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """An error the user can act on; its message is a single line naming the key / file and what is allowed."""


def one_line(text: object, limit: int = 300) -> str:
    """``text`` squeezed to one line (library messages often span several), cut at ``limit`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
