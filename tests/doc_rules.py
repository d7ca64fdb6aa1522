"""The rules tests/test_docs.py holds a baked project's docs to, beside its commands (readme_commands.py): links
resolve, and every measured figure says where it comes from.

Links. Every relative markdown link (`[text](path)`, `![alt](path)`, `[text](path#anchor)`, `[text](#anchor)`)
outside code points to a file of the bake, and its anchor to a heading of that file, slugged as GitHub does
(lower case, punctuation but `-` and `_` dropped, spaces to `-`, a repeated heading `-1`, `-2`, ...). Links with a
scheme (https:, mailto:) are not followed. A page named in plain text as `vendor/ddpkit/docs/NAME.md` (in a
preset, an error message, a comment) must exist too.

Figures. A measured figure in prose is a number with a unit of time (µs, us, ms, s, seconds, min, minutes, h,
hours), of size (KB, MB, GB, TB, KiB, MiB, GiB), a percentage, or a ratio written `<number>x` (a speed-up, 0.85x):
`(?<![\\w.])<number>(\\s?<unit>|x)(?![\\w%])`, so `8x8`, `2x2` and `32 steps` are not figures. Every unit of prose
holding one must name where it comes from: a date (`20YY-MM-DD`), a test (`test_...`), or `measurements.md` (the
template repository's record of runs). The units: a paragraph; each item of a list; each row of a table, which may
also draw its source from the table's header row and from the paragraph just before the table (its caption, e.g.
"Measured once, 2026-12-02, ..."). Fenced code blocks (commands, their output, formulas) and inline code spans are
not prose: a value written as code is one you set, and a figure whose number also appears in a code span of the
same unit (`SIGUSR1@90` beside "90 s", `--doctor.min_step_ms` (10)) is that setting, not a measurement.
"""

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", flags=re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", flags=re.MULTILINE)
PAGE_MENTION = re.compile(r"vendor/ddpkit/docs/([\w-]+\.md)")
UNITS = r"µs|us|ms|s|sec|seconds?|min|minutes?|h|hours?|KB|MB|GB|TB|KiB|MiB|GiB|%"
QUANTITY = re.compile(rf"(?<![\w.])(\d+(?:[.,]\d+)*)(?:\s?(?:{UNITS})|x)(?![\w%])")
SOURCE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\btest_\w+|measurements\.md")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


def prose(markdown: str) -> str:
    """`markdown` without its fenced code blocks (each becomes a blank line, which ends the block around it)."""
    return FENCE.sub("\n", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a page's headings (outside code), with GitHub's suffixes for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(markdown)):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, -1) + 1 if base in seen else 0
    return found


def dead_links(path: Path, root: Path) -> list[str]:
    """The relative links of the markdown file `path` that do not resolve to a file under `root`, or whose anchor is
    no heading of that file."""
    dead = []
    for target in LINK.findall(CODE_SPAN.sub("", prose(path.read_text()))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.is_file() or not linked.is_relative_to(root.resolve()):
            dead.append(f"{path.relative_to(root)}: {target} (no such file in the project)")
        elif anchor and anchor not in anchors(linked.read_text()):
            dead.append(f"{path.relative_to(root)}: {target} (no heading '{anchor}' in {linked.name})")
    return dead


@dataclass
class Unit:
    """A unit of prose the figures rule judges, and the text it may also draw its source from (a table's header
    and caption)."""

    text: str
    context: str = ""


def units(markdown: str) -> list[Unit]:
    """The paragraphs, list items and table rows of `markdown`'s prose (see the module's docstring)."""
    found: list[Unit] = []
    previous = ""  # the block before, a table's caption
    for block in re.split(r"\n[ \t]*\n", prose(markdown)):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if all(line.lstrip().startswith("|") for line in lines):
            context = previous + "\n" + lines[0]
            found += [Unit(row, context) for row in lines[2:]]
        else:
            current: list[str] = []
            for line in lines:
                if (LIST_ITEM.match(line) or line.lstrip().startswith("#")) and current:
                    found.append(Unit("\n".join(current)))
                    current = []
                current.append(line)
            found.append(Unit("\n".join(current)))
        previous = block
    return found


def unsourced(unit: Unit) -> list[str]:
    """The figures in `unit` that are measurements (not settings written as code) when neither the unit nor its
    context names a source; [] when it does."""
    if SOURCE.search(unit.text) or SOURCE.search(unit.context):
        return []
    code = " ".join(CODE_SPAN.findall(unit.text))
    figures = [m for m in QUANTITY.finditer(CODE_SPAN.sub("", unit.text))]
    return [m.group(0) for m in figures if not re.search(rf"(?<![\d.]){re.escape(m.group(1))}(?![\d.])", code)]


def unsourced_figures(path: Path) -> list[str]:
    """One line per unit of `path` that states a measured figure without its source: the figures and the unit's
    opening words."""
    return [
        f"{path.name}: {figures} in: {' '.join(unit.text.split())[:160]}"
        for unit in units(path.read_text())
        if (figures := unsourced(unit))
    ]
