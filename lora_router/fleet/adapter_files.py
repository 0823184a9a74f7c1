"""What an adapter directory holds, as one digest: how the router tells new weights published
under a name it already serves from the weights it loaded under that name itself.

Rules:

- Two loads of one name are the same adapter only when the router read the same files for
  both: every regular file under the directory (symbolic links to directories not followed),
  by relative path and content (sha256). `read_digest` returns None when it cannot tell:
  the directory or its `adapter_config.json` missing or unreadable, or more than `MAX_FILES`
  files (a path that is not an adapter). The caller treats None as "different from anything".
- It reads what the router's process sees at that path, which is the trainer's own view when the
  router runs beside the trainer (the deployment the guide describes).

Blocking file I/O: callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
MAX_FILES = 1000


def read_digest(path: str) -> str | None:
    """The digest of the adapter directory at `path`, or None (module docstring)."""
    root = Path(path)
    try:
        if not (root / CONFIG_FILE).is_file():
            return None
        files: list[str] = []
        for folder, _, names in os.walk(root):
            files.extend(os.path.join(folder, n) for n in names)
            if len(files) > MAX_FILES:
                return None
        total = hashlib.sha256()
        for file in sorted(files):
            if not os.path.isfile(file):
                continue  # a socket, a dangling link: not something vLLM reads
            relative = os.path.relpath(file, root).encode("utf-8", "surrogateescape")
            with open(file, "rb") as f:
                content = hashlib.file_digest(f, "sha256").digest()
            total.update(len(relative).to_bytes(4, "big") + relative + content)
        return "sha256:" + total.hexdigest()
    except OSError:
        return None
