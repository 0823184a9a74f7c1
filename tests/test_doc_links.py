"""Every relative link in the docs resolves, and every bench/results path they name exists.

Links: `[text](target)` and images in README.md, docs/**/*.md, bench/README.md and every
bench/results/**/README.md, resolved against the linking file's directory; a `#fragment` on a
markdown target must name one of its headings (GitHub's anchors). Paths: every
`bench/results/...` written out in README.md, docs, bench/README.md, lora_router/ and tests/
names a file or directory of the tree, or a prefix of one (`REV:bench/results/...` names a
path in git's history and is skipped). Not checked for paths: the result files (records of the
commands as run) and the bench scripts (which name where they write).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
RESULTS_PATH = re.compile(r"(?<![\w:/])bench/results/[\w./-]*")  # not `git show REV:path`
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def linking_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [ROOT / "bench" / "README.md"] if (ROOT / "bench" / "README.md").exists() else []
    return files + sorted((ROOT / "bench" / "results").rglob("README.md"))


def naming_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [p for p in [ROOT / "bench" / "README.md"] if p.exists()]
    files += sorted((ROOT / "lora_router").rglob("*.py"))
    return files + [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, fragment = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        if not dest.exists():
            bad.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves() -> None:
    bad = [b for path in linking_files() for b in broken_links(path)]
    assert not bad, "\n".join(bad)


def test_every_bench_results_path_named_in_docs_and_code_exists() -> None:
    tree = [str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*")]
    bad = []
    for path in naming_files():
        for named in RESULTS_PATH.findall(path.read_text()):
            named = named.rstrip(".,;:/")
            if not (ROOT / named).exists() and not any(t.startswith(named) for t in tree):
                bad.append(f"{path.relative_to(ROOT)}: {named}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-here) [gone](missing.md) [no](there.md#elsewhere) "
        "`[code](skipped.md)` [web](https://example.com)\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#elsewhere (no such heading)",
    ]
