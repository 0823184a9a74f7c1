"""Process plumbing shared by the benchmarks: child processes, ports, /proc readings, git.

Everything here talks only to 127.0.0.1. Processes are started with `Procs.start()` and always
stopped by `Procs.close()`, so a benchmark that fails half-way leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from lora_router.testbed.net import free_port  # noqa: F401 (bench/lib imports it from here)

# The repository: `git archive` and `git describe` run at its root (in bench/, `git archive`
# archives bench/ only).
ROOT = Path(__file__).resolve().parents[2]


def pinned(argv: Sequence[str], cpus: str | None) -> list[str]:
    """`argv` run on the given CPUs (taskset), where taskset exists."""
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus, *argv]
    return list(argv)


def find_binary(name: str, peers_bin: Path) -> str | None:
    """A peer router's executable: in `peers_bin`, else on PATH (`pip install .[bench]`)."""
    local = peers_bin / name
    return str(local) if local.exists() else shutil.which(name)


def source_tree(rev: str, into: Path) -> Path:
    """`git archive REV` of this repository, unpacked into the new directory `into`: an older
    revision to run beside this checkout (with PYTHONPATH on it) in one bench run."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
    ).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    if not (into / "lora_router" / "cli.py").exists():
        raise RuntimeError(f"{rev} has no lora_router/cli.py")
    return into


def git_revision() -> str:
    """`git describe` of this checkout, for the results' provenance ("?" without git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, its threads and its live children (nginx workers)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return ticks / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(int(c)) for c in children)


def cpu_split(pid: int) -> tuple[float, float, int]:
    """`cpu_seconds` as (user seconds, system seconds, minor page faults), children included.
    The kernel splits a process's CPU time into user and system by the ticks it sampled, so a
    split is exact only over many ticks (a 2-second window holds a few hundred)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    user = (int(fields[11]) + int(fields[13])) / tick  # utime cutime
    system = (int(fields[12]) + int(fields[14])) / tick  # stime cstime
    faults = int(fields[7]) + int(fields[8])  # minflt cminflt
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        u, s, f = cpu_split(int(child))
        user, system, faults = user + u, system + s, faults + f
    return user, system, faults


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process's own threads (no children); NaN once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def precise_cpu_seconds(pid: int) -> float:
    """CPU time of every thread of a process, to the nanosecond (schedstat): /proc/stat's
    10 ms ticks are too coarse for an idle router's milliseconds per second."""
    return (
        sum(
            int(stat.read_text().split()[0])
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat")
        )
        / 1e9
    )


def rss_kib(pid: int) -> int:
    """Resident memory of a process and its live children (nginx workers), in KiB."""
    kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            kib = int(line.split()[1])
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return kib + sum(rss_kib(int(c)) for c in children)


class Procs:
    """Child processes of one benchmark run."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, str] = {}
        self._started = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="lora-router-bench-"))
        self.tmp.chmod(0o755)  # nginx workers drop root and must read the reply files

    def start(
        self, argv: Sequence[str], cpus: str | None = None, **kw: object
    ) -> subprocess.Popen[bytes]:
        argv = pinned(argv, cpus)
        self._started += 1  # a log name per process ever started: a restart never reuses one
        log = open(self.tmp / f"proc-{self._started}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
        log.close()
        self.procs.append(proc)
        self.logs[proc.pid] = log.name
        return proc

    def log_tail(self, pid: int, lines: int = 20) -> str:
        path = self.logs.get(pid)
        return (
            "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) if path else ""
        )

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)
        shutil.rmtree(self.tmp, ignore_errors=True)

    @contextlib.contextmanager
    def run(self, keep_logs: str | None = None) -> Iterator[Procs]:
        """A run's processes: on an error, each one's log tail goes to stderr; at the end
        their logs are copied to `keep_logs` (if given) and every one is stopped."""
        try:
            yield self
        except BaseException:
            for proc in self.procs:
                print(f"--- {proc.args!r}\n{self.log_tail(proc.pid)}", file=sys.stderr)
            raise
        finally:
            if keep_logs:
                shutil.copytree(self.tmp, keep_logs, dirs_exist_ok=True)
            self.close()
