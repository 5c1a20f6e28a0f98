"""How a bench hands over its result: the markdown table printed, and with ``--out`` the JSON there and the same
table beside it (``<out>.md``), so a device call's folder holds both."""

from __future__ import annotations

import json
import os


def write_report(out: str | None, result: dict, table: str) -> None:
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(table + "\n")
