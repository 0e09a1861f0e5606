"""JSON text of prompt files and data sets, parsed so that every bad value is a JSONDecodeError.

``json.loads`` raises other errors for two kinds of text it cannot read: RecursionError
for arrays or objects nested deeper than the interpreter's recursion limit (a line of
200,000 brackets), and a plain ValueError for an integer longer than Python converts
(4300 digits). Both escaped the readers' ``except json.JSONDecodeError`` and ended
``bench`` in a traceback. Here they become the same error as any other bad JSON, which the
readers turn into one line naming the file and line.
"""

from __future__ import annotations

import json
from typing import Any

TOO_DEEP = "nested too deeply"


def json_value(text: str) -> Any:
    """``json.loads(text)``; raises only ``json.JSONDecodeError`` for text it cannot read."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, text, 0) from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion: ...; use ..."
        raise json.JSONDecodeError(str(exc).split(";")[0], text, 0) from None
