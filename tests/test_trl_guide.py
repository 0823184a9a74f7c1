"""docs/trl-guide.md's copy-paste commands run as written (docs/verify_trl_guide.py).

The script pastes steps 3 to 6 into bash against emulated replicas and a real router, and
plays the trainer's calls up to its first completion; these tests run it on the guide, and on
copies of the guide with one mistake each, which it must catch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "trl-guide.md"
ROUTER_TOKEN_LINES = "    --token-env REPLICA_TOKEN \\\n    --port 8000 > router.log"
GUARD = 'if __name__ == "__main__":'


def verify(guide: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "docs" / "verify_trl_guide.py"), "--guide", str(guide)],
        capture_output=True,
        text=True,
        timeout=240,
    )


def guide_with(tmp_path: Path, old: str, new: str) -> Path:
    text = GUIDE.read_text()
    assert text.count(old) == 1, old
    copy = tmp_path / "trl-guide.md"
    copy.write_text(text.replace(old, new))
    return copy


def test_the_guide_runs_as_written() -> None:
    run = verify(GUIDE)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok: trl-policy-v1 loaded" in run.stdout


def test_a_renamed_router_flag_fails_with_the_router_s_own_message(tmp_path: Path) -> None:
    wrong = ROUTER_TOKEN_LINES.replace("--token-env", "--token-variable")
    run = verify(guide_with(tmp_path, ROUTER_TOKEN_LINES, wrong))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL" in run.stdout and "--token-variable" in run.stdout, run.stdout


def test_a_trainer_script_without_the_main_guard_fails(tmp_path: Path) -> None:
    text = GUIDE.read_text()
    guard_line = next(line for line in text.splitlines() if line.startswith(GUARD))
    run = verify(guide_with(tmp_path, guard_line + "\n    main()", "main()"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "guard" in run.stdout, run.stdout
