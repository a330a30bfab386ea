"""The README and docs/ stay true to the repository: the one layout map names only paths that exist, every
relative link leads to a file (and a heading) that exists, and the README stays a front door."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260

# Links allowed to point at a missing file, each with the reason. Remove an entry once its file exists.
MISSING_ALLOWED: set[str] = set()

INDENT = 2        # the map nests a folder's entries two spaces deeper than the folder
DESCRIPTION = 24  # descriptions start at this column; a line indented this far continues a description


def layout_block(text: str) -> str:
    """The first code block under design.md's "## Layout" heading."""
    section = text.split("\n## Layout\n", 1)[1]
    match = re.search(r"^```\n(.*?)^```$", section, re.S | re.M)
    assert match, "docs/design.md: no code block under ## Layout"
    return match.group(1)


def layout_paths(block: str) -> list[str]:
    """Every path the map names, relative to the repository root.

    A line is `<indent><names>  <description>`: names before the first run of two spaces, separated by
    commas; a name ending in "/" is a folder whose entries follow, indented two spaces more. Lines indented
    to the description column continue the description above them.
    """
    paths: list[str] = []
    parents: list[str] = []  # the folder at each indent level
    for number, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION:
            continue
        assert indent % INDENT == 0, f"layout map line {number}: indent {indent} is not a multiple of {INDENT}: {line!r}"
        level = indent // INDENT
        assert level <= len(parents), f"layout map line {number}: indented under no folder: {line!r}"
        del parents[level:]
        names = [name.strip() for name in re.split(r" {2,}", line.strip(), maxsplit=1)[0].split(",")]
        assert all(names), f"layout map line {number}: an empty name in {line!r}"
        prefix = "".join(parents)
        paths.extend(prefix + name for name in names)
        if len(names) == 1 and names[0].endswith("/"):
            parents.append(names[0])
    return paths


def test_layout_parser_reads_nesting_lists_and_continuations():
    block = ("a/                      folder\n"
             "  b.py, c.py            two files\n"
             "                        a description that goes on\n"
             "  d/\n"
             "    e.py                deeper\n"
             "f.txt                   back at the top\n")
    assert layout_paths(block) == ["a/", "a/b.py", "a/c.py", "a/d/", "a/d/e.py", "f.txt"]


def test_layout_map_is_the_one_map():
    """The map lives in docs/design.md only; the README links to it instead of keeping a copy."""
    for page in PAGES:
        if page != DESIGN:
            text = page.read_text()
            assert "| `engine/" not in text and "| path | what it holds |" not in text, \
                f"{page.relative_to(ROOT)} keeps a layout table: the one map is docs/design.md's Layout"


def test_layout_map_names_only_existing_paths():
    paths = layout_paths(layout_block(DESIGN.read_text()))
    assert len(paths) > 50, f"the layout map parsed to only {len(paths)} paths: {paths}"
    for expected in ("syncseg/engine/", "syncseg/commands/", "syncseg/engine/trainer.py",
                     "syncseg/commands/train.py", "model/sync_batchnorm/batchnorm.py"):
        assert expected in paths, f"the layout map does not name {expected}"
    missing = [path for path in paths
               if not (ROOT / path).exists() or (path.endswith("/") and not (ROOT / path).is_dir())]
    assert not missing, f"docs/design.md's layout map names paths that do not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    """Inline and reference-style link targets outside code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    inline = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    reference = re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    return inline + reference


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_existing_files_and_headings(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
        if not resolved.exists():
            if relative not in MISSING_ALLOWED:
                broken.append(f"{target} (no file {relative})")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {relative})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a page in docs/"


def test_readme_states_the_test_command_and_the_python_api():
    """CI's .ci/run runs `make test`, which the README names; its Python API example is one python block."""
    readme = (ROOT / "README.md").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    tests = readme.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    assert "`make test` runs everything" in tests
    api = readme.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^```python\nimport syncseg\n.*?^```$", api, re.S | re.M)


# the folders whose every file the layout map names (model/sync_batchnorm/tests is the package's own, mapped
# as one entry)
MAPPED_FOLDERS = ("syncseg", "model", "data", "configs", "scripts")


def test_layout_map_names_every_file_of_the_packages_and_scripts():
    """The map matches the tree the other way too: a module added without its line fails here."""
    paths = set(layout_paths(layout_block(DESIGN.read_text())))
    named_folders = {path.rstrip("/") for path in paths if path.endswith("/")}
    unnamed = []
    for top in MAPPED_FOLDERS:
        for path in sorted((ROOT / top).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if path.is_dir() or "__pycache__" in relative or relative.endswith(".pyc") \
                    or path.name in ("__init__.py", "py.typed") or ".egg-info" in relative or "/build/" in relative:
                continue
            parents = [parent.as_posix() for parent in Path(relative).parents][:-1]
            in_named_leaf = any(parent in named_folders and not any(p.startswith(parent + "/") and p != parent + "/"
                                                                    for p in paths)
                                for parent in parents)
            if relative not in paths and not in_named_leaf:
                unnamed.append(relative)
    assert not unnamed, f"docs/design.md's layout map does not name: {unnamed}"
