"""What an adapter directory holds, as one digest: how the router tells new weights published
under a name it already serves from the weights it loaded under that name itself.

Rules:

- Two loads of one name are the same adapter only when the router read the same files for
  both: every regular file under the directory (symbolic links to directories not followed),
  by relative path and content (sha256). `read_digest` returns None when it cannot tell:
  the directory or its `adapter_config.json` missing or unreadable, more than `MAX_FILES`
  files (a path that is not an adapter), a link to a file outside the directory, more than
  `MAX_BYTES` in all, or reading for longer than `MAX_SECONDS` (a slow or hostile mount).
  The caller treats None as "different from anything", and reads it outside the broadcast
  lock, so no size of directory holds another sync.
- A path is judged before any replica is asked (`path_problem`), so a mistake is answered at
  once instead of at `--load-deadline`: a relative path is refused (vLLM would resolve it in
  its own working directory), and so is a path that does not exist where the router runs
  while its parent does (the router sees the mount, and the trainer writes the directory
  before it asks for the load). A path whose parent the router cannot see (another machine's
  mount) is not judged: the replicas' answers decide, as before.
- It reads what the router's process sees at that path, which is the trainer's own view when the
  router runs beside the trainer (the deployment the guide describes).

Blocking file I/O: callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
MAX_FILES = 1000
MAX_BYTES = 4 << 30  # a rank-64 adapter of a 70B model is about 1.6 GB
MAX_SECONDS = 20.0


def path_problem(path: str) -> str | None:
    """Why `path` cannot be the adapter directory a load names, as far as the router can see
    (module docstring); None when it may be, or when the router cannot tell."""
    if not os.path.isabs(path):
        return (
            "is a relative path: each replica would look for it in its own working directory; "
            "give the absolute path at which the replicas mount the adapter directory"
        )
    parent = os.path.dirname(os.path.normpath(path))
    try:
        if os.path.isdir(parent) and not os.path.lexists(path):
            return (
                f"does not exist, although its parent {parent} does where the router runs "
                "(a typo, or a directory the trainer has not written yet?)"
            )
    except OSError:
        return None
    return None


def read_digest(path: str) -> str | None:
    """The digest of the adapter directory at `path`, or None (module docstring)."""
    root = Path(path)
    try:
        if not (root / CONFIG_FILE).is_file():
            return None
        real_root = os.path.realpath(root)
        files: list[tuple[str, str]] = []  # (as named under the root, where it really is)
        for folder, _, names in os.walk(root):
            for name in names:
                file = os.path.join(folder, name)
                real = os.path.realpath(file)
                if os.path.commonpath([real_root, real]) != real_root:
                    return None  # a link out of the directory: not read
                files.append((file, real))
            if len(files) > MAX_FILES:
                return None
        files = [(f, real) for f, real in files if os.path.isfile(real)]  # no sockets, FIFOs
        if sum(os.path.getsize(real) for _, real in files) > MAX_BYTES:
            return None
        deadline = time.monotonic() + MAX_SECONDS
        total = hashlib.sha256()
        for file, real in sorted(files):
            relative = os.path.relpath(file, root).encode("utf-8", "surrogateescape")
            content = _file_digest(real, deadline)
            if content is None:
                return None
            total.update(len(relative).to_bytes(4, "big") + relative + content)
        return "sha256:" + total.hexdigest()
    except OSError:
        return None


def _file_digest(path: str, deadline: float) -> bytes | None:
    """sha256 of one file, or None past `deadline` or `MAX_BYTES` (it may grow meanwhile)."""
    digest = hashlib.sha256()
    read = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            read += len(chunk)
            if read > MAX_BYTES or time.monotonic() > deadline:
                return None
            digest.update(chunk)
    return digest.digest()
