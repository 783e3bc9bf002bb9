"""README.md and docs/: every link and file reference resolves inside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A file of the repository named in backticks, e.g. `worker/kinds/grpo.py` or
# `tests/test_client.py::test_name` (the test must exist too).
FILE_REF = re.compile(r"`((?:api|worker|shared|cli|tests|bench|scripts|examples|docs|\.ci)/[\w./-]*\w)(?:::(\w+))?")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def prose(page: Path) -> str:
    return page.read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_inside_the_repository(page):
    assert PAGES[1:], "docs/ has no pages"
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not file.is_file():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_named_exists_and_nothing_points_outside(page):
    text = prose(page)
    outside = re.findall(r"(?<![.\w])\.\./[\w./-]*", re.sub(r"\]\([^)]*\)", "", text))  # `.../x` elides, `../x` leaves
    assert not outside, f"{page.name} names paths outside the repository: {outside}"
    missing = []
    for path, test_name in FILE_REF.findall(text):
        file = ROOT / path
        if not file.exists():
            missing.append(path)
        elif test_name and not re.search(rf"^(async )?def {test_name}\b", file.read_text(), flags=re.M):
            missing.append(f"{path}::{test_name}")
    assert not missing, f"{page.name} names what does not exist: {missing}"


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10_500, len(readme.encode())
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in readme
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme)}
    assert {p.name for p in PAGES[1:]} <= linked, "README links every page of docs/"
