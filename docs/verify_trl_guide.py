"""Run docs/trl-guide.md's copy-paste commands, as written, against emulated replicas.

    python docs/verify_trl_guide.py [--guide docs/trl-guide.md]

Needs lora-router's own environment (its commands on PATH or beside this interpreter, bash and
curl), not TRL: the trainer script is read, never run. The guide marks the blocks it checks
with `<!-- verify_trl_guide: NAME -->`:

- `rehearsal` (step 3) runs in a bash of its own, its ports 9001 and 9002 made free ones; it
  must exit 0 (its `--check` passes) and leave no emulator listening.
- `replica` (step 2) gives the emulated replicas' `--max-lora-rank` and `--max-loras`; two
  `lora-router-emulator` processes serve the model `trainer` names, with an `--api-key`.
- `check`, `router` and `run` (steps 4 to 6) are pasted into one bash, in that order, as a user
  pastes them, with only this replaced: the replica URLs by the emulators', `hf_...` by their
  token, the router's port 8000 by a free one. `run`'s `python train.py` line hands over to
  this script, which makes the calls TRL's trainer makes up to its first completion (readiness,
  `/server_info` against the script's `LoraConfig` and `max_staleness` as TRL's
  `select_adapter_sync` judges it, `/v1/models` entry 0, pause, load
  `<output_dir>/.vllm_lora/trl-policy-v1`, resume, a token-id completion under it) on the URL
  the script names; then the block's stop command must stop the router.
- `trainer` (step 6) is parsed: it builds its trainer inside a function, called under
  `if __name__ == "__main__":` (TRL's rollout worker is a spawned process that imports it).

Every wait is bounded. Exits 0 when each step did what the guide says, 1 naming the first that
did not; it stops every process it started.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

GUIDE = Path(__file__).resolve().parent / "trl-guide.md"
TOKEN = "verify-token"
HAND_OVER = "verify_trl_guide: train.py starts here"
STEP_TIMEOUT_S = 60.0


class GuideError(Exception):
    """A step of the guide did not do what the guide says."""


def blocks(guide: str) -> dict[str, str]:
    """The code of each marked block, by its marker's name."""
    found = re.findall(r"<!-- verify_trl_guide: (\w+) -->\n```\w*\n(.*?)^```", guide, re.S | re.M)
    return dict(found)


def replace(text: str, old: str, new: str | Callable[[re.Match[str]], str], what: str) -> str:
    """`text` with every match of the regex `old` replaced; the guide must contain one."""
    out, n = re.subn(old, new, text)
    if not n:
        raise GuideError(f"{what}: {old!r} is not in the guide's block any more")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: object = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=STEP_TIMEOUT_S) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def call(method: str, url: str, body: object = None) -> bytes:
    status, answer = http(method, url, body)
    if status != 200:
        raise GuideError(f"{method} {url}: {status} {answer[:300]!r}")
    return answer


def wait_answering(url: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            http("GET", url)
            return
        except OSError:
            time.sleep(0.05)
    raise GuideError(f"{url} never answered")


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Trainer:
    """What `train.py` asks of the router: read from its source, never imported."""

    def __init__(self, source: str) -> None:
        tree = ast.parse(source)
        self.keywords: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for kw in node.keywords:
                    if kw.arg and isinstance(kw.value, ast.Constant):
                        self.keywords[f"{node.func.id}.{kw.arg}"] = kw.value.value
        for name in ("AsyncGRPOConfig.vllm_server_base_url", "AsyncGRPOConfig.output_dir"):
            if name not in self.keywords:
                raise GuideError(f"train.py: no {name} given as a literal")
        if not Path(str(self.keywords["AsyncGRPOConfig.output_dir"])).is_absolute():
            raise GuideError("train.py: output_dir is not absolute (the replicas read that path)")
        guarded = [
            node
            for node in tree.body
            if isinstance(node, ast.If)
            and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'
        ]
        if not guarded:
            raise GuideError('train.py: no `if __name__ == "__main__":` guard at module level')
        for node in tree.body:
            at_import = node not in guarded and not isinstance(node, ast.FunctionDef)
            if at_import and "AsyncGRPOTrainer(" in ast.unparse(node):
                raise GuideError("train.py builds its trainer at import: the worker re-runs it")

    def get(self, name: str, default: object = None) -> object:
        return self.keywords.get(name, default)


def first_sync_and_completion(trainer: Trainer, url: str, output_dir: Path) -> str:
    """TRL 1.16's calls, from the trainer's build to its first completion under trl-policy-v1."""
    from lora_router.emulator import write_adapter

    call("GET", url + "/health")
    info = json.loads(call("GET", url + "/server_info?config_format=json"))["vllm_config"]
    lora = info["lora_config"]
    rank = int(str(trainer.get("LoraConfig.r", 8)))
    staleness = int(str(trainer.get("AsyncGRPOConfig.max_staleness", 4)))
    if lora is None or info["parallel_config"]["data_parallel_size"] != 1:
        raise GuideError("/server_info: TRL would fall back to merged-weight sync")
    if lora["max_lora_rank"] < rank or lora["max_loras"] < staleness + 2:
        raise GuideError(f"/server_info {lora}: TRL raises for r={rank}, staleness {staleness}")
    models = json.loads(call("GET", url + "/v1/models"))["data"]
    if models[0]["id"] != trainer.get("AsyncGRPOTrainer.model"):
        raise GuideError(f"/v1/models entry 0 is {models[0]['id']}, not the trainer's model")
    adapter = write_adapter(output_dir / ".vllm_lora" / "trl-policy-v1", rank=rank)
    call("POST", url + "/pause?mode=keep")
    load = {"lora_name": "trl-policy-v1", "lora_path": str(adapter)}
    call("POST", url + "/v1/load_lora_adapter", load)
    call("POST", url + "/resume")
    body = {"model": "trl-policy-v1", "prompt": [9707, 11, 1879, 0], "max_tokens": 8, "seed": 7}
    answer = json.loads(call("POST", url + "/v1/completions", body))
    return f"trl-policy-v1 loaded from {adapter}, completion {answer['choices'][0]['text']!r}"


@contextmanager
def bash(script: str, cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """`script` in `bash -e`, in a process group of its own (killed, whatever is left, at exit)."""
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print("  | " + line, end="")
            out.put(line)
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def finished(proc: subprocess.Popen[str], what: str) -> None:
    try:
        code = proc.wait(timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise GuideError(f"{what} did not finish in {STEP_TIMEOUT_S} s") from exc
    if code != 0:
        raise GuideError(f"{what} exited {code}")


def rehearsal(block: str, workdir: Path, env: dict[str, str]) -> None:
    ports = [free_port(), free_port()]
    script = replace(block, r"\b9001\b", str(ports[0]), "rehearsal")
    script = replace(script, r"\b9002\b", str(ports[1]), "rehearsal")
    with bash(script, workdir, env) as proc:
        lines_of(proc)
        finished(proc, "step 3's rehearsal")
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not all(refused(p) for p in ports):
        if time.monotonic() > deadline:
            raise GuideError("step 3's rehearsal left an emulator listening")
        time.sleep(0.05)


@contextmanager
def emulators(replica: str, model: str, env: dict[str, str]) -> Iterator[list[str]]:
    """Two emulated replicas, with the flags step 2 gives vLLM; yields their URLs."""
    flags = re.findall(r"(--max-lora-rank|--max-loras) (\d+)", replica)
    if len(flags) != 2:
        raise GuideError(f"step 2: expected --max-lora-rank and --max-loras, found {flags}")
    argv = [flag for pair in flags for flag in pair]
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            command = ["lora-router-emulator", "--port", str(port), "--api-key", TOKEN]
            procs.append(subprocess.Popen([*command, "--model", model, *argv], env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_answering(url + "/health")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def session(parts: dict[str, str], trainer: Trainer, workdir: Path, env: dict[str, str]) -> str:
    """Steps 4 to 6 in one bash; the trainer's calls where `python train.py` stands."""
    model = str(trainer.get("AsyncGRPOTrainer.model"))
    port = free_port()
    with emulators(parts["replica"], model, env) as urls:
        script = "\n".join(parts[name] for name in ("check", "router", "run"))
        script = replace(
            script,
            r"https://replica-(\d)\.example:8000",
            lambda m: urls[int(m.group(1))],
            "steps 4-5: the replica URLs",
        )
        script = replace(script, r"hf_\.\.\.", TOKEN, "step 4: the token")
        script = replace(script, r"--port 8000\b", f"--port {port}", "step 5: the port")
        script = replace(script, r"127\.0\.0\.1:8000\b", f"127.0.0.1:{port}", "the router's URL")
        script = replace(
            script, r"(?m)^python train\.py.*$", f"echo '{HAND_OVER}'; read -r _", "step 6's run"
        )
        base = str(trainer.get("AsyncGRPOConfig.vllm_server_base_url"))
        if base != "http://127.0.0.1:8000":
            raise GuideError(f"train.py talks to {base}, not the router step 5 starts")
        with bash(script, workdir, env) as proc:
            lines = lines_of(proc)
            deadline = time.monotonic() + 4 * STEP_TIMEOUT_S
            while True:
                try:
                    line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty as exc:
                    raise GuideError("steps 4-6 never reached `python train.py`") from exc
                if line is None:
                    raise GuideError(f"steps 4-6 ended before `python train.py`: {proc.wait()}")
                if line.rstrip().endswith(HAND_OVER):  # curl ends its output with no newline
                    break
            output_dir = workdir / "output_dir"
            done = first_sync_and_completion(trainer, f"http://127.0.0.1:{port}", output_dir)
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.close()
            finished(proc, "step 6's stop command")
            if not refused(port):
                raise GuideError("the router still listens after step 6's stop command")
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guide", type=Path, default=GUIDE)
    guide = parser.parse_args().guide.read_text()
    parts = blocks(guide)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    workdir = Path(tempfile.mkdtemp(prefix="verify-trl-guide-"))
    try:
        missing = {"rehearsal", "replica", "check", "router", "trainer", "run"} - parts.keys()
        if missing:
            raise GuideError(f"the guide marks no block {sorted(missing)}")
        trainer = Trainer(parts["trainer"])
        print("step 3: the rehearsal")
        rehearsal(parts["rehearsal"], workdir, env)
        print("steps 4-6: check, router, trainer's first sync and completion, stop")
        print("ok: " + session(parts, trainer, workdir, env))
        return 0
    except GuideError as exc:
        log = workdir / "router.log"
        if log.exists():
            print("router.log:\n" + log.read_text()[-3000:])
        print(f"FAIL: {exc}")
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
