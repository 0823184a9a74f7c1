"""Untrusted text made safe for the operator's terminal: what `top` and `--check` print.

Names and messages that come from a replica or the trainer (adapter and model names, URLs,
error messages) are shown literally, never interpreted: every character Python does not call
printable (`str.isprintable`: Unicode's control, format and separator categories but the space,
so C0, DEL, C1, ESC sequences, bidirectional overrides, line breaks) is written as its visible
escape (`\\x1b`, `\\u202e`), and a backslash doubled, so that an escape is never ambiguous.
Rich markup is a matter of the renderer: `top` gives rich `Text` objects only, which rich never
parses as markup.

Pure: returns strings, prints nothing. O(length) for a string that needs escaping; a printable
one without a backslash is returned as is.
"""

from __future__ import annotations

from typing import Any


def shown(text: str) -> str:
    """`text` with every unprintable character escaped visibly (module docstring)."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escaped(c) for c in text)


def shown_json(doc: Any) -> Any:
    """A decoded JSON document with every string in it, keys included, `shown`."""
    if isinstance(doc, str):
        return shown(doc)
    if isinstance(doc, dict):
        return {shown(str(k)): shown_json(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [shown_json(v) for v in doc]
    return doc


def _escaped(c: str) -> str:
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    code = ord(c)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
