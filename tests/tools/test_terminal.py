"""Untrusted names reach the operator's terminal as plain text (tools/terminal.py): over real
sockets, replicas whose adapters and model carry rich markup and escape sequences, then
`top --once` and `--check`, which exit normally and print every name literally, its control
characters escaped."""

from __future__ import annotations

import io
import re
from pathlib import Path

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import router_config, run_top

from lora_router.emulator import EmulatorConfig, write_adapter
from lora_router.tools.check import check, report
from lora_router.tools.terminal import shown

MARKUP = "x[/bogus]"  # rich reads a closing tag that matches nothing as an error
CLEAR = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, set the window title
C1 = "csi\x9b31mred\x7f"  # the 8-bit CSI, and DEL
BIDI = "abc\u202edcba"  # a right-to-left override
HOSTILE = (MARKUP, CLEAR, C1, BIDI)
# Any byte a terminal would act on: C0 but the line feed, DEL, and C1 (as UTF-8 or bare).
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trl-policy-v7", "trl-policy-v7"),
        ("école/ünïcode", "école/ünïcode"),
        (MARKUP, MARKUP),
        (CLEAR, "\\x1b[2J\\x1b]0;pwned\\x07"),
        (C1, "csi\\x9b31mred\\x7f"),
        (BIDI, "abc\\u202edcba"),
        ("two\nlines\ttab\r", "two\\x0alines\\x09tab\\x0d"),
        ("a\\x1b", "a\\\\x1b"),  # a backslash typed in a name is not an escape
    ],
)
def test_a_name_is_shown_with_its_control_characters_escaped(text: str, expected: str) -> None:
    assert shown(text) == expected


async def load_on(url: str, name: str, path: Path) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_top_once_shows_hostile_adapter_names_as_plain_text(
    emulators: StartEmulators, router: StartRouter, tmp_path: Path
) -> None:
    emus = await emulators(len(HOSTILE))
    for emu, name in zip(emus, HOSTILE, strict=True):
        # Left on the replica by an earlier run: the router lists what each replica holds.
        await load_on(emu.url, name, write_adapter(tmp_path / str(len(name)), rank=1))
    rt = await router(emus)
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0 and err == "", err
    assert not RAW.search(out), RAW.findall(out)
    for name in HOSTILE:
        assert shown(name) in out


async def test_check_shows_hostile_model_and_adapter_names_as_plain_text(tmp_path: Path) -> None:
    from lora_router.emulator import start_emulator

    model = "m\x1b]8;;http://127.0.0.1:9/\x07link\x1b]8;;\x07"  # a hyperlink escape
    emus = [await start_emulator(EmulatorConfig(model=model)) for _ in HOSTILE]
    try:
        for emu, name in zip(emus, HOSTILE, strict=True):
            await load_on(emu.url, name, write_adapter(tmp_path / str(len(name)), rank=1))
        fleet, problems = await check(router_config(e.url for e in emus))
    finally:
        for emu in emus:
            await emu.stop()
    out = io.StringIO()
    print(report(fleet, problems, 1), file=out)
    text = out.getvalue()
    assert not RAW.search(text), RAW.findall(text)
    assert shown(model) in text and "leftover adapter" in text
    for name in HOSTILE:
        assert shown(name) in text
