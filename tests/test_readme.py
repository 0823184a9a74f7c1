"""The README is a front page (at most 200 lines); every figure the docs quote is in its source.

The documents checked are DOCS: README.md, bench/README.md, docs/*.md and docs/design/*.md. A
*figure* is a number written out next to a link to a result under bench/results/ (the link
taken from the folder of the document that holds it): in the same table row, list item or
paragraph of prose. It is taken with what is glued to it (`1.49x`, `87.5%`) and a unit word
after it (`73 MiB`, `3 ejections`), and must appear, written the same way, in one of the
results that row or paragraph links: a figure copied wrong, rounded, or taken from another run
fails. A result is a text file (.md, .txt, .json), or a directory: its README.md, or without
one the text files in it. Numbers inside code spans (commands), code blocks, link targets and
file names are not figures, nor are an issue's number (`#27`) and a run of seven or more
digits: that is a revision (figures are written `100,000`). Figures next to links only to
results that are not text (an image) fail too, as does a link to a result that does not exist:
nothing there backs them.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200

DOCS = ("README.md", "bench/README.md", "docs/*.md", "docs/design/*.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
CODE = re.compile(r"`[^`\n]*`")
FILE_NAME = re.compile(r"[\w./-]+\.(?:md|txt|json|png|py|diff|patch)\b")
REVISION = re.compile(r"(?<![\w.,])\d{7,}(?![\w.,])")
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNITS = "µs|ms|s|MiB|KiB|req/s|replicas|ejections|pairs|cells"
FIGURE = re.compile(
    rf"(?<![\w.,#])({NUMBER})([%x\u00d7]?)(?![\w]|[.,]\d)(?:\s+({UNITS})(?![\w/]))?"
)
TEXT_SUFFIXES = (".md", ".txt", ".json")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.) ")


def figures(passage: str) -> list[str]:
    """The figures of one passage, each as it must be found in its source."""
    prose = CODE.sub("", LINK_TARGET.sub("]", passage))
    prose = REVISION.sub("", FILE_NAME.sub("", prose))
    found = FIGURE.findall(prose)
    return [number + glued + (f" {unit}" if unit else "") for number, glued, unit in found]


def found_in(figure: str, text: str) -> bool:
    number, _, unit = figure.partition(" ")
    pattern = rf"(?<![\w.,]){re.escape(number)}(?![\w]|[.,]\d)"
    if unit:
        pattern += rf"\s+{re.escape(unit)}(?![\w/])"
    return re.search(pattern, text) is not None


def passages(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each table row, paragraph and list item; no code blocks."""
    out: list[tuple[int, str]] = []
    paragraph: list[str] = []
    start, fenced = 0, False
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            fenced = not fenced
        ends = fenced or line.startswith("```") or not line.strip() or line.startswith("|")
        if paragraph and (ends or LIST_ITEM.match(line)):
            out.append((start, " ".join(paragraph)))
            paragraph = []
        if ends:
            if line.startswith("|") and not fenced:
                out.append((n, line))
            continue
        start = start if paragraph else n
        paragraph.append(line)
    return out


def result_links(doc: Path, passage: str, root: Path) -> list[Path]:
    """The results under root's bench/results/ that a passage of `doc` links."""
    results = root / "bench" / "results"
    targets = [(doc.parent / t).resolve() for t in LINK.findall(passage) if "://" not in t]
    return [t for t in targets if t.is_relative_to(results)]


@functools.cache
def source_texts(result: Path) -> tuple[str, ...]:
    """The texts that back a result's figures: none for a result that is not text or is missing."""
    files = [result]
    if result.is_dir():
        readme = result / "README.md"
        files = [readme] if readme.is_file() else sorted(result.iterdir())
    return tuple(f.read_text() for f in files if f.is_file() and f.suffix in TEXT_SUFFIXES)


def unbacked_figures(doc: Path, root: Path) -> list[str]:
    """Every figure next to a bench/results link in `doc` that none of the linked results has."""
    root = root.resolve()
    name = doc.resolve().relative_to(root)
    bad = []
    for n, passage in passages(doc.read_text()):
        sources = result_links(doc, passage, root)
        bad += [
            f"{name}:{n}: {p.relative_to(root)} does not exist" for p in sources if not p.exists()
        ]
        texts = [text for p in sources for text in source_texts(p)]
        names = ", ".join(str(p.relative_to(root)) for p in sources)
        for figure in figures(passage) if sources else []:
            if not any(found_in(figure, text) for text in texts):
                bad.append(f"{name}:{n}: {figure!r} is not in {names}")
    return bad


def quoted_passages(doc: Path) -> list[str]:
    """The passages of `doc` whose figures the check holds to a linked result."""
    text = doc.read_text()
    return [p for _, p in passages(text) if result_links(doc, p, ROOT) and figures(p)]


def documents(root: Path) -> list[Path]:
    """The documents whose figures are checked, in DOCS' order."""
    return [p for pattern in DOCS for p in sorted(root.glob(pattern))]


def test_the_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the front page keeps to {MAX_LINES}"


def test_every_figure_next_to_a_results_link_is_in_that_file() -> None:
    bad = [line for doc in documents(ROOT) for line in unbacked_figures(doc, ROOT)]
    assert not bad, "\n".join(bad)


def test_the_docs_quote_figures_from_the_results() -> None:
    # The check above proves nothing on a document whose figures it cannot see next to a link.
    least = {"README.md": 5, "bench/README.md": 15}
    least |= {"docs/design/overhead.md": 5, "docs/design/routing.md": 10}
    quoted = {name: len(quoted_passages(ROOT / name)) for name in least}
    assert all(quoted[name] >= n for name, n in least.items()), quoted


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


def test_a_nested_document_s_links_are_taken_from_its_folder(tmp_path: Path) -> None:
    # The fake results take the real tree's names: tests/test_doc_links.py holds every
    # bench/results path written out in tests/ to the tree, so the missing one is built.
    seeds = tmp_path / "bench" / "results" / "routing-seeds"
    (seeds / "replay").mkdir(parents=True)
    (seeds / "README.md").write_text("worst cell 0.997, paired median 0.987 over 195 pairs\n")
    (seeds / "replay" / "budget-1-300.md").write_text("hit rate 0.999\n")
    missing = str((seeds.parent / "gone.md").relative_to(tmp_path))
    design = tmp_path / "docs" / "design"
    design.mkdir(parents=True)
    (tmp_path / "docs" / "README.md").write_text("0.5 here would fail, but no doc links it\n")
    doc = design / "routing.md"
    doc.write_text(
        "Worst cell 0.997, median 0.987 over 195 pairs ([s](../../bench/results/routing-seeds/)).\n"
        "\n"
        "Worst cell 0.998 ([seeds](../../bench/results/routing-seeds/README.md#worst)).\n"
        "\n"
        "Hit rate 0.999 and 0.98 ([replay](../../bench/results/routing-seeds/replay)).\n"
        "\n"
        "- Worst cell 0.997 ([seeds](../../bench/results/routing-seeds/)), and on\n"
        "  a continued line 0.998.\n"
        "- 0.5 in the next item, which links nothing.\n"
        "\n"
        "| 2 replicas at 1948024 (#31) |"
        " [budget-1-300.md](../../bench/results/routing-seeds/replay/budget-1-300.md) |\n"
        f"| 0.997 | [gone](../../{missing}), [readme](../README.md) |\n"
        "| 0.5, linked from the wrong folder | [seeds](bench/results/routing-seeds/README.md) |\n"
    )
    assert unbacked_figures(doc, tmp_path) == [
        "docs/design/routing.md:3: '0.998' is not in bench/results/routing-seeds/README.md",
        "docs/design/routing.md:5: '0.98' is not in bench/results/routing-seeds/replay",
        "docs/design/routing.md:7: '0.998' is not in bench/results/routing-seeds",
        "docs/design/routing.md:11: '2 replicas' is not in "
        "bench/results/routing-seeds/replay/budget-1-300.md",
        f"docs/design/routing.md:12: {missing} does not exist",
        f"docs/design/routing.md:12: '0.997' is not in {missing}",
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
