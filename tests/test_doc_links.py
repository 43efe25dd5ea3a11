"""Every relative link in README.md, benchmarks/README.md and docs/*.md resolves: the file (or folder) it names
exists and, where it names an anchor, that file has a heading whose GitHub anchor it is. A docs page or image named
in code (`docs/x.md`) exists too. Pages move and headings get renamed; a reader who follows a link should land where
it promised. The README and the performance page stay within their lengths."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
NAMED_PAGE = re.compile(r"`(docs/[\w.-]+\.(?:md|png))`")
EXTERNAL = ("http://", "https://", "mailto:")
# The README is what a TRL user reads first, the performance page answers a few questions with current numbers only:
# what grows past these belongs in a page of its own (docs/) or in docs/history.md.
MOST_LINES = {"README.md": 320, "docs/performance.md": 400}


def prose(text: str) -> str:
    """The text outside fenced and indented code blocks, with inline code spans blanked (a link there is code)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            kept.append(CODE_SPAN.sub("``", line))
    return "\n".join(kept)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text; a repeated one gets GitHub's -1, -2, ... suffix."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            base = anchor(heading.group(1))
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return found


def broken_links(document: Path) -> list[str]:
    """The links and docs pages named in code of a document that lead nowhere, each with the reason."""
    text = document.read_text()
    broken = [f"`{page}`: no such file" for page in NAMED_PAGE.findall(text) if not (ROOT / page).exists()]
    for target in LINK.findall(prose(text)):
        if target.startswith(EXTERNAL):
            continue
        path, _, fragment = target.partition("#")
        page = (document.parent / path).resolve() if path else document
        if not page.exists():
            broken.append(f"{target}: no file {page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}")
        elif fragment and page.suffix == ".md" and fragment not in anchors(page.read_text()):
            broken.append(f"{target}: no heading with anchor #{fragment} in {page.name}")
    return broken


def test_every_relative_link_and_named_page_resolves():
    broken = {str(document.relative_to(ROOT)): broken_links(document) for document in DOCUMENTS}
    assert {name: reasons for name, reasons in broken.items() if reasons} == {}


def test_links_are_read_outside_code_and_anchors_as_github_makes_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Speed\n## Speed\n## vLLM (`use_vllm=True`)\n## How fast is TRL's `generate`?\n"
        "[a](#speed-1) [b](#vllm-use_vllmtrue) [c](#how-fast-is-trls-generate) [d](missing.md) [e](#nowhere)\n"
        "`[f](missing-in-code.md)`\n\n    [g](missing-in-block.md)\n```\n[h](missing-in-fence.md)\n```\n"
        "![i](page.md#speed) [j](https://example.com/x) `docs/no-such-page.md`\n"
    )
    assert broken_links(page) == [
        "`docs/no-such-page.md`: no such file",
        f"missing.md: no file {(tmp_path / 'missing.md').resolve()}",
        "#nowhere: no heading with anchor #nowhere in page.md",
    ]


def test_the_readme_and_the_performance_page_stay_short():
    lines = {name: len((ROOT / name).read_text().splitlines()) for name in MOST_LINES}
    assert {name: count for name, count in lines.items() if count > MOST_LINES[name]} == {}


# A work item's number means nothing to a user (the project has no public tracker): code, tests and the docs say what
# a target or a rule is instead. The history page keeps dates and what was superseded, CHANGELOG.md its own record.
WORK_ITEM = re.compile(r"\bissue[s]? ?#?\d+|\bissue's\b|\bthe issue\b|\bitem \d+\b|\bmust-have\b", re.IGNORECASE)
UNLABELLED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"] + [
    path for folder in ("trl_dapo", "recipes", "benchmarks", "tests") for path in sorted((ROOT / folder).rglob("*.py"))
]


def test_no_work_item_labels_in_code_or_user_docs():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for path in UNLABELLED
        if path.name != "history.md" and path != Path(__file__)
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if WORK_ITEM.search(line)
    ]
    assert found == [], "say what the target or rule is instead:\n" + "\n".join(found)
