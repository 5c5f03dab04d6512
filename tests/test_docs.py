"""The docs stay true to the code and the README stays short.

docs/configuration.md is generated from the settings table (`make docs`); a setting added,
renamed or given a new default without regenerating it fails here. README.md is the page a
newcomer reads in five minutes: the manual lives in docs/, and the README may not grow
past 12 KB again. Relative links in README.md and docs/ must lead to a file and, with an
anchor, to a heading of it.
"""

import re
from pathlib import Path

from protocol import settings_doc
from protocol.settings import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 12 * 1024


def test_configuration_reference_is_current():
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert written == settings_doc.markdown(), "docs/configuration.md is stale: run `make docs`"


def test_configuration_reference_names_every_setting():
    text = settings_doc.markdown()
    for s in SETTINGS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{s.flag}`"))
        assert f"`{s.env}`" in row and f"`{s.name}`" in row and s.help in row
        assert f"| {s.show(s.default)} |" in row or s.factory is not None


def test_readme_is_short():
    assert (ROOT / "README.md").stat().st_size <= README_LIMIT


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists() or (anchor and dest.suffix == ".md"
                                     and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken
