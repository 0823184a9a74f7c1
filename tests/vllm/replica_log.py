"""What a vLLM replica's own log says happened, read from the harness's log format.

The replicas run with replica_logging.json (every line starts with the time, in seconds with
microseconds, on the machine's one clock, so lines of two replicas can be ordered) and with
`--enable-log-requests --max-log-len 100`. The lines read here:

- `Loaded new LoRA adapter: name 'N', path 'P'` (vLLM's serving.py, before it answers the load);
- `Request ID details: ... prompt_token_ids: [...]` then `Received request ID: ...
  lora_request: LoRARequest(lora_name='N', ...)` (its request logger, as a request arrives;
  `lora_request: None` for the base model);
- the access log, `"METHOD PATH HTTP/1.1" STATUS` once each request is answered.

Only the part of a log written since `offset` (`Replica.log_size()` taken earlier) is read, so a
test sees only what happened during it on replicas the tier shares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_TIME = r"^(?P<t>\d+\.\d+) "
LOADED = re.compile(_TIME + r".*Loaded new LoRA adapter: name '(?P<name>[^']+)'", re.M)
DETAILS = re.compile(
    _TIME + r".*Request (?P<id>\S+) details: .*?prompt_token_ids: \[(?P<ids>[^\]]*)\]", re.M
)
RECEIVED = re.compile(
    _TIME + r".*Received request (?P<id>\S+): .*lora_request: "
    r"(?:None|LoRARequest\(lora_name='(?P<name>[^']+)')",
    re.M,
)
ACCESS = re.compile(
    _TIME + r'.*"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/1\.1" (?P<status>\d{3})', re.M
)


@dataclass(frozen=True, slots=True)
class Request:
    """A completion as the replica received it."""

    t: float
    id: str
    adapter: str | None  # None: the base model
    head: tuple[int, ...]  # its first prompt tokens (up to --max-log-len)


@dataclass(frozen=True, slots=True)
class Access:
    t: float
    method: str
    path: str
    status: int


def text_since(log: Path, offset: int) -> str:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def loads(text: str) -> list[tuple[float, str]]:
    """(time, adapter name) of every adapter the replica loaded, in order."""
    return [(float(m["t"]), m["name"]) for m in LOADED.finditer(text)]


def requests(text: str) -> list[Request]:
    """Every request the replica received, in order, with its prompt's head."""
    heads = {
        m["id"]: tuple(int(x) for x in m["ids"].split(",") if x.strip())
        for m in DETAILS.finditer(text)
    }
    return [
        Request(float(m["t"]), m["id"], m["name"], heads.get(m["id"], ()))
        for m in RECEIVED.finditer(text)
    ]


def accesses(text: str) -> list[Access]:
    """Every answered request of the access log, in order."""
    return [
        Access(float(m["t"]), m["method"], m["path"], int(m["status"]))
        for m in ACCESS.finditer(text)
    ]
