"""`lora-router-emulator` as a command: its `--help`, its default vLLM version, and Ctrl-C."""

from __future__ import annotations

import subprocess
import sys

from help_text import assert_every_flag_described
from interrupt import assert_one_line, interrupt_when_ready

from lora_router.emulator.cli import build_parser


def test_every_flag_in_help_is_described_with_one_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lora_router.emulator", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    assert_every_flag_described(build_parser(), result.stdout)


def test_a_bad_flag_is_one_line_and_status_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lora_router.emulator", "--port", "eighty"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "lora-router-emulator: error: argument --port: invalid int value: 'eighty' (see --help)"
    ]


async def test_ctrl_c_stops_it_with_one_line_and_status_130() -> None:
    result = await interrupt_when_ready(
        ["lora_router.emulator", "--port", "0"], r"serving .* on http://127\.0\.0\.1:\d+\n"
    )
    assert_one_line(result, "lora-router-emulator")
    # By default it is the vLLM line the docs and the real-vLLM tier were checked against.
    assert "(full, vLLM 0.32.0)" in result.before
