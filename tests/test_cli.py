"""`lora-router`: flags to Config, one clear line and status 2 for anything unusable, and a
SIGTERM that lets in-flight requests finish before exiting 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import uvloop
from help_text import assert_every_flag_described, help_entries
from helpers import router_process
from interrupt import assert_one_line, interrupt_when_ready

from lora_router.cli import UsageError, build_config, build_parser, main
from lora_router.config import Config, ReplicaAddress
from lora_router.emulator import EmulatorConfig, start_emulator

TOKEN = "hf_cli-tok3n-NEVER-LEAK"
ENV = {"HF_TOKEN": TOKEN, "API_KEY": "k", "EMPTY": ""}


def config(*argv: str, environ: dict[str, str] | None = None):
    return build_config(build_parser().parse_args(list(argv)), ENV if environ is None else environ)


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_router.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_group_of_flags() -> None:
    result = run("--help")
    assert result.returncode == 0
    for flag in (
        "--replicas",
        "--token-env",
        "--ca-file",
        "--api-key-env",
        "--max-body-bytes",
        "--header-timeout",
        "--max-connections",
        "--max-upstream-connections",
    ):
        assert flag in result.stdout


def test_a_good_command_line_builds_the_config() -> None:
    c = config(
        "--replicas",
        "http://a:8000,https://b.example/prefix/",
        "--token-env",
        "HF_TOKEN",
        "--max-body-bytes",
        "1000",
        "--header-timeout",
        "2.5",
        "--port",
        "0",
    )
    assert [r.name for r in c.replicas] == ["http://a:8000", "https://b.example:443/prefix"]
    assert c.token.reveal() == TOKEN and TOKEN not in repr(c)
    assert c.max_body_bytes == 1000 and c.header_timeout == 2.5 and c.port == 0


def test_the_move_price_is_a_flag_and_zero_turns_moves_off() -> None:
    assert config("--replicas", "http://a", "--no-token").move_price == 10
    off = config("--replicas", "http://a", "--no-token", "--move-price", "0")
    assert off.move_price == 0


def test_the_pace_rule_is_on_by_default_and_no_pace_turns_it_off() -> None:
    assert config("--replicas", "http://a", "--no-token").pace is True
    assert config("--replicas", "http://a", "--no-token", "--no-pace").pace is False


def test_the_kv_policy_and_its_event_sources_are_flags() -> None:
    default = config("--replicas", "http://a", "--no-token")
    assert (default.policy, default.kv_events) == ("prefix", "auto")
    kv = config(
        "--replicas",
        "http://a",
        "--no-token",
        "--policy",
        "kv",
        "--kv-events",
        "tcp://{host}:5557,tcp://{host}:5558",
    )
    assert (kv.policy, kv.kv_events) == ("kv", "tcp://{host}:5557,tcp://{host}:5558")


BAD = {
    "no replicas": ["--token-env", "HF_TOKEN"],
    "empty replicas": ["--replicas", "", "--token-env", "HF_TOKEN"],
    "only commas": ["--replicas", " , ,", "--token-env", "HF_TOKEN"],
    "not a url": ["--replicas", "replica-1:8000", "--token-env", "HF_TOKEN"],
    "ftp url": ["--replicas", "ftp://a", "--token-env", "HF_TOKEN"],
    "bad port": ["--replicas", "http://a:99999", "--token-env", "HF_TOKEN"],
    "credentials in url": ["--replicas", "http://u:p@a", "--token-env", "HF_TOKEN"],
    "twice": ["--replicas", "http://a:80,http://a", "--token-env", "HF_TOKEN"],
    "token unset": ["--replicas", "http://a", "--token-env", "NOPE"],
    "token empty": ["--replicas", "http://a", "--token-env", "EMPTY"],
    "no token flag": ["--replicas", "http://a"],
    "api key unset": ["--replicas", "http://a", "--no-token", "--api-key-env", "NOPE"],
    "public without key": ["--replicas", "http://a", "--no-token", "--host", "0.0.0.0"],
    "missing ca file": ["--replicas", "https://a", "--no-token", "--ca-file", "/nonexistent"],
    "negative timeout": ["--replicas", "http://a", "--no-token", "--header-timeout", "-1"],
    "nan timeout": ["--replicas", "http://a", "--no-token", "--idle-timeout", "nan"],
    "zero body limit": ["--replicas", "http://a", "--no-token", "--max-body-bytes", "0"],
    "port too big": ["--replicas", "http://a", "--no-token", "--port", "70000"],
    "negative move price": ["--replicas", "http://a", "--no-token", "--move-price", "-1"],
    "kv events not tcp": ["--replicas", "http://a", "--no-token", "--kv-events", "ipc:///x"],
    "kv events no host": ["--replicas", "http://a", "--no-token", "--kv-events", "tcp://h:1"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_unusable_command_lines_are_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        config(*argv)


def test_a_ca_file_that_is_not_pem_is_a_usage_error(tmp_path) -> None:
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(UsageError, match="--ca-file"):
        config("--replicas", "https://a", "--no-token", "--ca-file", str(bogus))


def test_public_listen_with_a_key_or_insecure_flag_is_allowed() -> None:
    assert (
        config(
            "--replicas", "http://a", "--no-token", "--host", "0.0.0.0", "--api-key-env", "API_KEY"
        ).api_key.reveal()
        == "k"
    )
    assert config(
        "--replicas", "http://a", "--no-token", "--host", "0.0.0.0", "--insecure-listen"
    ).insecure_listen


@pytest.mark.parametrize(
    "argv",
    [
        ["--replicas", "http://a", "--token-env", "NOPE"],
        ["--replicas", "not a url", "--no-token"],
        ["--replicas", "http://a", "--no-token", "--no-such-flag"],
        ["--replicas", "http://a", "--no-token", "--port", "eighty"],
        ["--replicas", "http://a", "--no-token", "--policy", "random"],
    ],
)
def test_bad_flags_are_a_one_line_usage_error(argv: list[str]) -> None:
    result = run(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-router: error: ")
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["--demo", "--steps", "many"], "lora-router --demo"),
        (["top", "--url", "ftp://127.0.0.1:8000"], "lora-router top"),
    ],
)
def test_the_subcommands_bad_flags_are_one_line_too(argv: list[str], prog: str) -> None:
    result = run(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr


def test_main_returns_2_without_starting(capsys, monkeypatch) -> None:
    monkeypatch.delenv("NOPE", raising=False)
    assert main(["--replicas", "http://a", "--token-env", "NOPE"]) == 2
    assert "NOPE" in capsys.readouterr().err


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0() -> None:
    uvloop.run(_sigterm_drains())


async def _sigterm_drains() -> None:
    # A slow replica: about 1 s for this completion.
    emu = await start_emulator(EmulatorConfig(port=0, decode_s_per_token=0.05, api_key=TOKEN))
    argv = ("--replicas", emu.url, "--token-env", "HF_TOKEN", "--shutdown-grace", "10")
    try:
        async with router_process(*argv, "--log-level", "debug", env={"HF_TOKEN": TOKEN}) as router:
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            body = b'{"model": "%s", "prompt": [1, 2, 3], "max_tokens": 20, "stream": true}' % (
                emu.config.model.encode()
            )
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(body) + body
            )
            async with asyncio.timeout(10):
                first = await reader.readuntil(b"data: ")  # the stream has started
            router.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                rest = await reader.read()  # to the close, after the whole stream
                code = await router.proc.wait()
                assert router.proc.stderr is not None
                log = router.log + await router.proc.stderr.read()
            answer = first + rest
            assert answer.startswith(b"HTTP/1.1 200")
            assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            assert code == 0, log
            with pytest.raises(OSError):  # no longer listening
                await asyncio.open_connection("127.0.0.1", router.port)
            assert TOKEN.encode() not in log and TOKEN.encode() not in answer
            writer.close()
    finally:
        await emu.stop()


async def test_ctrl_c_stops_the_router_with_one_line_and_status_130() -> None:
    emu = await start_emulator(EmulatorConfig(port=0))
    try:
        argv = ["lora_router.cli", "--replicas", emu.url, "--no-token", "--port", "0"]
        result = await interrupt_when_ready(argv, r"listening on .*\n", on="stderr")
    finally:
        await emu.stop()
    assert_one_line(result, "lora-router")


async def test_a_second_ctrl_c_exits_at_once_with_status_130() -> None:
    emu = await start_emulator(EmulatorConfig(port=0))
    emu.faults.stall = True  # the request below stays in flight
    argv = ("--replicas", emu.url, "--no-token", "--shutdown-grace", "120")
    try:
        async with router_process(*argv) as router:
            async with asyncio.timeout(20):
                _, writer = await asyncio.open_connection("127.0.0.1", router.port)
                body = b'{"prompt": [1, 2, 3], "max_tokens": 5}'
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json"
                    b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
                while emu.faults.stalled == 0:
                    await asyncio.sleep(0.01)
                router.proc.send_signal(signal.SIGINT)
                await router.read_until(rb"Ctrl-C again to exit now")
            assert b"up to 120 s (--shutdown-grace) for 1 request(s)" in router.log
            router.proc.send_signal(signal.SIGINT)
            async with asyncio.timeout(5):  # not the 120 s of grace
                code = await router.proc.wait()
                assert router.proc.stderr is not None
                log = router.log + await router.proc.stderr.read()
            assert code == 130, log
            assert log.rstrip().endswith(b"lora-router: interrupted")
            writer.close()
    finally:
        emu.faults.stall = False
        await emu.stop()


async def test_ctrl_c_stops_check_with_one_line_and_status_130() -> None:
    # A replica that accepts and never answers: once it is asked, --check is probing it.
    asked = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await reader.read()  # until the check goes away
        writer.close()

    replica = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{replica.sockets[0].getsockname()[1]}"
    try:
        argv = ["lora_router.cli", "--check", "--replicas", url, "--no-token"]
        result = await interrupt_when_ready(argv, asked)
    finally:
        replica.close()
    assert_one_line(result, "lora-router")


def test_every_flag_in_help_is_described_with_one_default() -> None:
    result = run("--help")
    assert result.returncode == 0
    assert_every_flag_described(build_parser(), result.stdout)


def test_help_ends_with_examples_of_every_command() -> None:
    result = run("--help")
    examples = result.stdout.split("\nexamples:\n")[1]
    for command in ("lora-router top", "--check", "--demo", "lora-router-emulator"):
        assert command in examples


def test_block_size_states_its_computed_default_once() -> None:
    text = help_entries(run("--help").stdout)["--block-size"]
    assert text.count("default") == 1 and "cache_config.block_size, else 16" in text


def test_no_token_with_token_env_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--token-env and --no-token"):
        config("--replicas", "http://a", "--token-env", "HF_TOKEN", "--no-token")


def test_python_dash_m_lora_router_is_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lora_router", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and result.stdout.startswith("lora-router ")


def start_on_a_port_in_use() -> tuple[subprocess.CompletedProcess[str], list[bool]]:
    """Run the router on a port something else listens on, with one replica that records
    connections: the finished process and one entry per connection the replica saw."""
    contacted: list[bool] = []

    async def scenario() -> subprocess.CompletedProcess[str]:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            contacted.append(True)
            writer.close()

        replica = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        busy = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        replica_port = replica.sockets[0].getsockname()[1]
        busy_port = busy.sockets[0].getsockname()[1]
        try:
            argv = ["--replicas", f"http://127.0.0.1:{replica_port}", "--no-token"]
            return await asyncio.to_thread(run, *argv, "--port", str(busy_port))
        finally:
            replica.close()
            busy.close()

    return uvloop.run(scenario()), contacted


def test_a_port_in_use_is_one_line_exit_2() -> None:
    result, _ = start_on_a_port_in_use()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lora-router: error: cannot listen on 127.0.0.1:")
    assert "in use" in lines[0]


def test_a_port_in_use_contacts_no_replica() -> None:
    _, contacted = start_on_a_port_in_use()
    assert contacted == []


def test_demo_refuses_flags_it_would_ignore() -> None:
    result = run("--demo", "--token-env", "HF_TOKEN", "--retries", "3")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith("lora-router: error: --demo starts its own")
    assert "--token-env, --retries have no meaning there" in line and "--vnodes" in line


def test_demo_checks_the_routing_flags_it_takes() -> None:
    result = run("--demo", "--load-factor", "-1")
    assert result.returncode == 2 and "--load-factor must be 0 or more" in result.stderr


def test_a_config_built_in_code_is_validated_too() -> None:
    address = ReplicaAddress.parse("http://127.0.0.1:9000")
    with pytest.raises(ValueError, match="--health-interval must be a positive number"):
        Config(replicas=(address,), health_interval=0.0)


@pytest.mark.parametrize(
    ("url", "spelling"),
    [
        ("http://gpu-1:8000", "http://gpu-1:8000/"),  # a trailing slash
        ("http://gpu-1:8000", "HTTP://GPU-1:8000"),  # the scheme's and host's case
        ("http://gpu-1", "http://gpu-1:80"),  # a default port
        ("https://gpu-1", "https://gpu-1:443/"),
        ("http://gpu-1:8000/v1", "http://gpu-1:8000/v1/"),
        ("http://gpu-1:8000/a/c", "http://gpu-1:8000/a/./b/../c"),  # dot segments
        ("http://gpu-1:8000", "http://gpu-1:8000/x/.."),
        ("http://[::1]:8000", "http://[0:0:0:0:0:0:0:1]:8000"),  # an IP address's forms
    ],
)
def test_spellings_of_one_url_name_one_replica(url: str, spelling: str) -> None:
    assert ReplicaAddress.parse(spelling).name == ReplicaAddress.parse(url).name
    assert ReplicaAddress.parse(spelling) == ReplicaAddress.parse(url)


@pytest.mark.parametrize(
    ("url", "other"),
    [
        ("http://gpu-1:8000", "http://gpu-2:8000"),
        ("http://gpu-1:8000", "https://gpu-1:8000"),
        ("http://gpu-1:8000", "http://gpu-1:8001"),
        ("http://gpu-1:8000/a", "http://gpu-1:8000/A"),  # a path is case-sensitive
        ("http://127.0.0.1:8000", "http://localhost:8000"),  # names are not resolved here
    ],
)
def test_urls_that_differ_after_normalising_name_two_replicas(url: str, other: str) -> None:
    assert ReplicaAddress.parse(url).name != ReplicaAddress.parse(other).name


def test_a_replica_listed_twice_under_two_spellings_is_refused_naming_it() -> None:
    urls = "http://127.0.0.1:9000,http://10.0.0.5:9000,HTTP://127.0.0.1:9000/"
    result = run("--replicas", urls, "--no-token")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith(
        "lora-router: error: --replicas names http://127.0.0.1:9000 twice (entries 1 and 3)"
    ), line
    assert "list it once" in line


def test_a_config_listening_beyond_loopback_without_an_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match="reachable beyond this machine"):
        Config(replicas=(), host="0.0.0.0")


# -- the trust boundary's flags (#27) -----------------------------------------------------------

PASTED = [
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",  # a valid variable name, but not a set one
    "ghp_" + "aB3" * 12,
    "sk-proj-AbC123_dEf",  # not a variable name at all
    "hf_AbC def",
    "Bearer hf_AbC",
]


@pytest.mark.parametrize("value", PASTED)
@pytest.mark.parametrize("flag", ["--token-env", "--api-key-env"])
def test_a_secret_pasted_in_place_of_a_variable_name_is_refused_and_never_echoed(
    flag: str, value: str
) -> None:
    token = [] if flag == "--token-env" else ["--no-token"]
    result = run("--replicas", "http://a", *token, flag, value)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lora-router: error: {flag}")
    assert value not in result.stderr + result.stdout
    assert not any(len(part) > 3 and part in result.stderr for part in value.split())


def test_top_does_not_echo_a_key_pasted_in_place_of_its_variable_name(capsys) -> None:
    from lora_router.tools.top import main as top

    assert top(["--api-key-env", PASTED[0], "--once"]) == 2
    assert PASTED[0] not in capsys.readouterr().err


def test_a_conventional_variable_name_that_is_unset_is_named() -> None:
    with pytest.raises(UsageError, match="--token-env HF_TOKEM: that variable is not set"):
        config("--replicas", "http://a", "--token-env", "HF_TOKEM")


def test_forward_paths_are_repeatable_and_refuse_a_guarded_route() -> None:
    c = config(
        "--replicas", "http://a", "--no-token", "--forward-path", "/v1/embeddings",
        "--forward-path", "/my/route",
    )  # fmt: skip
    assert c.forward_paths == ("/v1/embeddings", "/my/route")
    for path in ("/pause", "/v1/completions", "/update_weights", "/health", "/x%2Fy", "/a//b"):
        with pytest.raises(UsageError, match="--forward-path"):
            config("--replicas", "http://a", "--no-token", "--forward-path", path)


@pytest.mark.parametrize(
    ("patterns", "url", "allowed"),
    [
        ((), "http://a:8000", True),  # the --replicas themselves
        ((), "http://a:8001", False),  # not another port of their host
        ((), "http://b:8000", False),
        (("*.hf.jobs",), "https://x--8000.hf.jobs", True),
        (("*.hf.jobs",), "https://X--8000.HF.JOBS", True),
        (("*.hf.jobs",), "https://hf.jobs.evil.example", False),
        (("*.hf.jobs:443",), "http://x.hf.jobs:80", False),
        (("10.0.0.0/8",), "http://10.1.2.3:8000", True),
        (("10.0.0.0/8",), "http://11.1.2.3:8000", False),
        (("10.0.0.0/8",), "http://ten.example:8000", False),  # names are never resolved
        (("10.0.0.5:8000",), "http://10.0.0.5:8000", True),
        (("10.0.0.5:8000",), "http://10.0.0.5:8001", False),
        (("[fd00::5]:8000",), "http://[fd00:0::5]:8000", True),
        (("fd00::/16",), "http://[fd00::9]:1", True),
    ],
)
def test_replica_hosts_decide_where_a_replica_may_be_added(
    patterns: tuple[str, ...], url: str, allowed: bool
) -> None:
    replicas = (ReplicaAddress.parse("http://a:8000"),)
    everywhere = (*patterns, "a:8000") if patterns else ()
    c = Config(replicas=replicas, replica_hosts=everywhere)
    assert c.replica_allowed(ReplicaAddress.parse(url)) is allowed


def test_replica_hosts_are_checked_and_must_cover_the_replicas() -> None:
    ok = config(
        "--replicas", "https://a.hf.jobs", "--no-token", "--replica-hosts", "*.hf.jobs, 10.0.0.0/8"
    )
    assert ok.replica_hosts == ("*.hf.jobs", "10.0.0.0/8")
    for bad in ("10.0.0.0/33", "a:port", "[::1", "a:99999"):
        with pytest.raises(UsageError, match="--replica-hosts"):
            config("--replicas", "http://a", "--no-token", "--replica-hosts", bad)
    with pytest.raises(UsageError, match="outside --replica-hosts"):
        config("--replicas", "http://b:80", "--no-token", "--replica-hosts", "a")


def test_discovery_flags_replace_replicas_and_need_the_allow_list() -> None:
    found = config(
        "--replicas-file",
        "/etc/replicas",
        "--replicas-dns",
        "vllm.ns.svc:8000",
        "--replicas-srv",
        "_vllm._tcp.ns.svc",
        "--replica-hosts",
        "10.0.0.0/8",
        "--no-token",
    )
    assert found.replicas == () and found.discovering
    assert found.replicas_files == ("/etc/replicas",)
    assert found.replicas_dns == ("vllm.ns.svc:8000",)
    assert found.replicas_srv == ("_vllm._tcp.ns.svc",)
    with pytest.raises(UsageError, match="needs --replica-hosts"):
        config("--replicas-file", "/etc/replicas", "--no-token")
    with pytest.raises(UsageError, match="--replicas is required"):
        config("--no-token")
    for bad in ("vllm.ns.svc", "vllm:http", ":8000"):
        with pytest.raises(UsageError, match="expected NAME:PORT"):
            config("--replicas-dns", bad, "--replica-hosts", "10.0.0.0/8", "--no-token")
    with pytest.raises(UsageError, match="--dns-server"):
        config(
            "--replicas-srv",
            "_x._tcp.y",
            "--replica-hosts",
            "a",
            "--no-token",
            "--dns-server",
            "127.0.0.1",
        )


def test_the_buffer_budget_holds_at_least_one_whole_body() -> None:
    with pytest.raises(UsageError, match="--max-buffered-bytes must be at least --max-body-bytes"):
        config(
            "--replicas",
            "http://a",
            "--no-token",
            "--max-body-bytes",
            "100",
            "--max-buffered-bytes",
            "99",
        )


def test_a_token_to_a_plain_http_replica_beyond_this_machine_is_cleartext() -> None:
    from lora_router.config import Secret

    c = Config(replicas=(), token=Secret("t"))
    assert c.cleartext_token(ReplicaAddress.parse("http://10.0.0.5:8000"))
    for url in ("https://10.0.0.5", "http://127.0.0.1:9", "http://[::1]:9", "http://localhost"):
        assert not c.cleartext_token(ReplicaAddress.parse(url))
    assert not Config(replicas=()).cleartext_token(ReplicaAddress.parse("http://10.0.0.5"))
