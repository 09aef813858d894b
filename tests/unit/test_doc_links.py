"""Every relative link in README.md, docs/*.md and benchmarks/*.md leads somewhere: the file (or folder)
exists, and a ``#anchor`` on a Markdown file names one of its headings as GitHub spells heading anchors
(or an HTML ``id``/``name``). Links in code spans and fenced code blocks are text, not links; absolute
URLs are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\"|\s+'[^']*')?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"""<[a-zA-Z][^>]*\s(?:id|name)\s*=\s*["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(1)
            elif fence.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            lines.append((number, line))
    return lines


def heading_text(markdown: str) -> str:
    """The text GitHub renders for a heading: links become their text, code and emphasis marks go."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, ``-``, ``_`` and
    spaces kept), each space a ``-``."""
    kept = "".join(ch for ch in heading_text(heading).strip().lower()
                   if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file: each heading's slug (repeats numbered -1, -2, ... as GitHub
    does) and each HTML id or name."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def link_targets(text: str) -> list[tuple[int, str]]:
    targets = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub(lambda span: " " * len(span.group(0)), line)  # code, not a link
        targets += [(number, match.group(1)) for match in INLINE_LINK.finditer(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append((number, definition.group(1)))
    return [(number, target.strip("<>")) for number, target in targets]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: target: why`` (paths relative to ``root``) for each relative link of ``path`` that
    leads nowhere."""
    problems = []
    for number, target in link_targets(path.read_text(encoding="utf-8")):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:, ...): not fetched
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no such file {linked.relative_to(root) if linked.is_relative_to(root) else linked}")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            problems.append(f"{where}: no heading with anchor #{anchor} in {linked.name}")
    return problems


@pytest.mark.parametrize("path", documents(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(path):
    assert not broken_links(path), "\n".join(broken_links(path))


@pytest.mark.parametrize(("heading", "slug"), [
    ("`ckpt_save.py`: checkpoint save paths on the same state", "ckpt_savepy-checkpoint-save-paths-on-the-same-state"),
    ("Exit codes", "exit-codes"),
    ("What `trainguard.Guard` does, step by step (v2)", "what-trainguardguard-does-step-by-step-v2"),
    ("[The commit protocol](architecture.md#the-commit-protocol)", "the-commit-protocol"),
    ("Results (2026-11-27, `--quick`, 2 CPU cores)", "results-2026-11-27---quick-2-cpu-cores"),
    ("Größe & Ärger", "größe--ärger"),
])
def test_heading_anchors_follow_githubs_rules(heading, slug):
    assert github_slug(heading) == slug


def test_a_broken_file_link_or_anchor_is_named_with_its_line(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "target.md").write_text("# Title\n\n## Exit codes\n\n## Exit codes\n")
    (docs / "page.md").write_text(
        "[ok](target.md#exit-codes) [repeat](target.md#exit-codes-1) [top](#a-page) [dir](.)\n"
        "# A page\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "`[in a code span](nowhere.md)` [web](https://example.com/x.md)\n"
        "[gone](missing.md) [no anchor](target.md#exit-code)\n"
        "[ref]: ./also-missing.md\n"
    )
    problems = broken_links(docs / "page.md", tmp_path)
    assert problems == [
        "docs/page.md:7: missing.md: no such file docs/missing.md",
        "docs/page.md:7: target.md#exit-code: no heading with anchor #exit-code in target.md",
        "docs/page.md:8: ./also-missing.md: no such file docs/also-missing.md",
    ]
