"""The README is a front page: at most 200 lines, and every figure it quotes is in its source.

A *figure* is a number written out next to a link to a result file under bench/results/ (a
text file: .md, .txt, .json): in the same table row, or in the same paragraph of prose. It is
taken with what is glued to it (`1.49x`, `87.5%`) and a unit word after it (`73 MiB`,
`3 ejections`), and must appear, written the same way, in one of the result files that row or
paragraph links: a figure copied wrong, rounded, or taken from another run fails. Numbers
inside code spans (commands), code blocks and link targets are not figures. Figures next to
links only to result files that are not text (an image) fail too: nothing there backs them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200

RESULT_LINK = re.compile(r"\]\((bench/results/[^)#\s]+)(?:#[^)]*)?\)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
CODE = re.compile(r"`[^`\n]*`")
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNITS = "µs|ms|s|MiB|KiB|req/s|replicas|ejections|pairs|cells"
FIGURE = re.compile(rf"(?<![\w.,])({NUMBER})([%x\u00d7]?)(?![\w]|[.,]\d)(?:\s+({UNITS})(?![\w/]))?")
TEXT_SUFFIXES = (".md", ".txt", ".json")


def figures(line: str) -> list[str]:
    """The figures of one README line, each as it must be found in its source."""
    prose = CODE.sub("", LINK_TARGET.sub("]", line))
    found = FIGURE.findall(prose)
    return [number + glued + (f" {unit}" if unit else "") for number, glued, unit in found]


def found_in(figure: str, text: str) -> bool:
    number, _, unit = figure.partition(" ")
    pattern = rf"(?<![\w.,]){re.escape(number)}(?![\w]|[.,]\d)"
    if unit:
        pattern += rf"\s+{re.escape(unit)}(?![\w/])"
    return re.search(pattern, text) is not None


def passages(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each table row and each paragraph; code blocks left out."""
    out: list[tuple[int, str]] = []
    paragraph: list[str] = []
    start, fenced = 0, False
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith("```") or not line.strip() or line.startswith("|"):
            if paragraph:
                out.append((start, " ".join(paragraph)))
                paragraph = []
            if line.startswith("|") and not fenced:
                out.append((n, line))
            continue
        start = start if paragraph else n
        paragraph.append(line)
    return out


def unbacked_figures(readme: Path, root: Path) -> list[str]:
    """Every figure next to a bench/results link that none of the linked text files has."""
    bad = []
    for n, line in passages(readme.read_text()):
        sources = [root / target for target in RESULT_LINK.findall(line)]
        if not sources:
            continue
        texts = [
            (p / "README.md" if p.is_dir() else p).read_text()
            for p in sources
            if p.is_dir() or p.suffix in TEXT_SUFFIXES
        ]
        for figure in figures(line):
            if not any(found_in(figure, text) for text in texts):
                names = ", ".join(str(p.relative_to(root)) for p in sources)
                bad.append(f"README.md:{n}: {figure!r} is not in {names}")
    return bad


def test_the_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the front page keeps to {MAX_LINES}"


def test_every_figure_next_to_a_results_link_is_in_that_file() -> None:
    bad = unbacked_figures(README, ROOT)
    assert not bad, "\n".join(bad)


def test_the_readme_quotes_figures_from_the_results() -> None:
    # The check above proves nothing on a README that links no result next to a figure.
    quoted = [p for _, p in passages(README.read_text()) if RESULT_LINK.search(p) and figures(p)]
    assert len(quoted) >= 5, quoted


def test_a_figure_not_in_the_linked_file_is_caught(tmp_path: Path) -> None:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "faults.md").write_text(
        "| listing flap | 3 ejections in 10.009 s (bound 7), 4 failed attempts |\n"
        "| throughput | 1.49x at 2 replicas, 0.86x in the worst; 1,498 [1,230 .. 1,861] req/s |\n"
    )
    (results / "routing.png").write_bytes(b"\x89PNG")
    readme = tmp_path / "README.md"
    readme.write_text(
        "| flap | 3 ejections in 10.009 s | [f](bench/results/faults.md) |\n"
        "| flap | 4 ejections in 10 s | [f](bench/results/faults.md) |\n"
        "| req/s | 1,498 [1,230 .. 1,861]: 1.49x, fresh 0.86x | [f](bench/results/faults.md) |\n"
        "| req/s | 1.5x, 1,500 | [f](bench/results/faults.md) |\n"
        "| run | `bench/faults.py --port-base 18200` | [f](bench/results/faults.md#listing) |\n"
        "| plot | 0.997 | ![p](bench/results/routing.png) |\n"
        "2,000 streams, no link: not checked\n"
        "\n"
        "A paragraph: re-admitted in 1.1323 s,\n"
        "then 1.16 s ([faults](bench/results/faults.md)).\n"
        "\n"
        "```\n"
        "| 99 in a code block | [f](bench/results/faults.md) |\n"
        "```\n"
    )
    (results / "faults.md").write_text(
        (results / "faults.md").read_text() + "re-admit: 1.1323 s, 1.02 s\n"
    )
    assert unbacked_figures(readme, tmp_path) == [
        "README.md:2: '4 ejections' is not in bench/results/faults.md",
        "README.md:2: '10 s' is not in bench/results/faults.md",
        "README.md:4: '1.5x' is not in bench/results/faults.md",
        "README.md:4: '1,500' is not in bench/results/faults.md",
        "README.md:6: '0.997' is not in bench/results/routing.png",
        "README.md:9: '1.16 s' is not in bench/results/faults.md",
    ]


def fenced_commands(markdown: str, heading: str) -> list[str]:
    """The commands of the first bash block under `heading`: `&&` chains split, comments cut."""
    section = markdown.split(f"\n{heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {heading}"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [command.strip() for line in lines for command in line.split(" && ") if line]


def ci_stages() -> list[str]:
    """What .ci/run runs, each command as its `stage MINUTES` line gives it."""
    text = (ROOT / ".ci" / "run").read_text()
    return [m.split("  #")[0].strip() for m in re.findall(r"^stage \d+ (.+)$", text, re.M)]


def test_ci_runs_the_readme_s_test_and_development_commands() -> None:
    text = README.read_text()
    commands = fenced_commands(text, "## Development") + [
        c for c in fenced_commands("\n## first\n" + text, "## first") if "pytest" in c
    ]
    stages = ci_stages()
    # ci installs with --quiet; everything else it runs as the README prints it (it may add flags).
    missing = [
        c
        for c in commands
        if not c.startswith("pip install") and not any(f"{s} ".startswith(f"{c} ") for s in stages)
    ]
    assert not missing, f"{missing} not in .ci/run's stages {stages}"
