"""The documents stay guides: docs/design.md a map short enough to read whole,
benchmarks/RESULTS.md a short page of current tables that names no path of the machine that
measured them, benchmarks/NOTES.md sections by topic whose index is whole, and every section
the code or the docs cite by title is there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "benchmarks" / "NOTES.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
DESIGN = ROOT / "docs" / "design.md"

RESULTS_MAX_LINES = 250
DESIGN_MAX_LINES = 450
# A path under a top-level directory of the measuring host names that host, not the repository
# (an endpoint such as /v1/completions does not start with one of these).
ABSOLUTE_PATH = re.compile(
    r"(?<![\w.~$/-])(?:/(?:work|root|tmp|home|usr|opt|mnt|var|srv|scratch|data)/|~/)")
_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
             "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth "
             "twentieth").split()
# "fifth session", "5th session", "session 5": a title that says when, not what.
SESSION = re.compile(
    r"\b(?:%s|\d+(?:st|nd|rd|th))[ -]sessions?\b|\bsession[ #]*\d+\b" % "|".join(_ORDINALS),
    re.IGNORECASE)
# How the code, the scripts and the docs cite a section: the document's name, a comma or an
# opening parenthesis, then the section's title in double quotes (or several joined by "," or
# "and"), wrapped over comment lines.
CITATION = re.compile(
    r'\b(NOTES|RESULTS)(?:\.md)?(?:,\s*\(?|\s*\()\s*("[^"]+"(?:\s*(?:,|;|and)\s*"[^"]+")*)')
CITING = ("cbatch", "csrc", "kernels", "benchmarks", "tests", "scripts", "docs")
SUFFIXES = {".py", ".pyi", ".cpp", ".h", ".cu", ".cuh", ".sh", ".md", ".toml", ".txt"}


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of each Markdown heading outside fenced code blocks, in document order."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{1,6}) +(.+?) *#*$", line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def github_anchors(titles: list[str]) -> list[str]:
    """GitHub's anchor of each heading, in order: the title's text in lower case, punctuation
    but hyphens and underscores dropped, spaces as hyphens; a repeat gets -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = []
    for title in titles:
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)     # a link's text stays
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.append(slug if count == 0 else f"{slug}-{count}")
    return anchors


def sections(path: Path) -> list[str]:
    """The titles of a document's sections (its `## ` headings)."""
    return [title for level, title in headings(path.read_text()) if level == 2]


def notes_index(text: str) -> list[tuple[str, str, str]]:
    """(title, anchor, outcome) of each index line above the first section."""
    head = text.split("\n## ", 1)[0]
    return re.findall(r"^- \[(.+?)\]\(#([^)\s]+)\):? *(.*)$", head, re.M)


def cited_sections() -> list[tuple[str, str, str]]:
    """(file, "NOTES" or "RESULTS", title) of every section cited by title."""
    paths = [p for folder in CITING for p in (ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in SUFFIXES and ".venv" not in p.parts]
    paths.append(ROOT / "README.md")
    cited = []
    for path in paths:
        # comment markers at line starts dropped, so that a wrapped citation reads whole
        text = re.sub(r"\n[ \t]*(?:#+|//+|\*)?[ \t]*", " ", path.read_text(errors="replace"))
        for doc, quotes in CITATION.findall(text):
            target = NOTES if doc == "NOTES" else RESULTS
            if path == target:
                continue
            for title in re.findall(r'"([^"]+)"', quotes):
                cited.append((str(path.relative_to(ROOT)), doc, title))
    return cited


def test_design_is_a_map_short_enough_to_read_whole():
    lines = DESIGN.read_text().splitlines()
    assert len(lines) <= DESIGN_MAX_LINES, (
        f"docs/design.md has {len(lines)} lines; the map of rooms and the data's path fits in "
        f"{DESIGN_MAX_LINES}: a kernel's or a format's specification goes in its own file's "
        f"top comment or docstring, and design.md names the file")


def test_results_is_short_and_names_no_path_of_the_measuring_machine():
    lines = RESULTS.read_text().splitlines()
    assert len(lines) <= RESULTS_MAX_LINES, (
        f"benchmarks/RESULTS.md has {len(lines)} lines; its current tables fit in "
        f"{RESULTS_MAX_LINES}, history goes to benchmarks/NOTES.md")
    paths = [(n, line) for n, line in enumerate(lines, 1) if ABSOLUTE_PATH.search(line)]
    assert not paths, f"benchmarks/RESULTS.md names absolute paths: {paths}"


def test_the_notes_index_lists_every_section_once_with_its_outcome():
    text = NOTES.read_text()
    index = notes_index(text)
    titles = sections(NOTES)
    listed = [title for title, _, _ in index]
    assert sorted(listed) == sorted(titles), (
        "in the index, not a section:", sorted(set(listed) - set(titles)),
        "a section missing from the index:", sorted(set(titles) - set(listed)),
        "listed twice:", sorted({t for t in listed if listed.count(t) > 1}))
    assert all(len(outcome.split()) >= 5 for _, _, outcome in index), [
        title for title, _, outcome in index if len(outcome.split()) < 5]


def test_every_index_link_reaches_its_section():
    text = NOTES.read_text()
    found = headings(text)
    anchors = dict(zip(github_anchors([title for _, title in found]), found))
    by_title = {title: anchor for anchor, (level, title) in anchors.items() if level == 2}
    wrong = [(title, anchor, by_title.get(title)) for title, anchor, _ in notes_index(text)
             if anchors.get(anchor, (0, None))[1] != title]
    assert not wrong, f"index links that reach no section, or another one: {wrong}"


def test_each_notes_section_opens_with_its_outcome():
    """The first thing under a section's title is its outcome in prose: not a table, a list,
    a subsection or the italic line that says where and when a subsection was measured."""
    text = NOTES.read_text()
    openings = re.findall(r"^## .+\n+(.*)$", text, re.M)
    assert len(openings) == len(sections(NOTES))
    bad = [line for line in openings
           if not line or line[0] in "#|*->" or line.startswith("```") or re.match(r"\d+\. ", line)]
    assert not bad, bad


def test_no_section_title_names_a_session():
    titled = [(path.name, title) for path in (NOTES, RESULTS)
              for _, title in headings(path.read_text()) if SESSION.search(title)]
    assert not titled, f"titles that name a session rather than a topic: {titled}"


def test_cited_sections_exist():
    """Comments, docs and the two documents cite sections by title (the start of it is
    enough); each one cited is a section of that document."""
    cited = cited_sections()
    names = {"NOTES": sections(NOTES), "RESULTS": sections(RESULTS)}
    assert any(path.startswith("csrc") for path, _, _ in cited)     # the pattern still matches
    missing = [(path, doc, title) for path, doc, title in cited
               if not any(section.startswith(title.rstrip(" .,")) for section in names[doc])]
    assert not missing, f"citations of sections that are not there: {missing}"
