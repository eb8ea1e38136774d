"""Fails on history wording in tracked files: the repository states what is, and history lives
in commit messages (``docs/perf_history.md`` names the commits).

Flagged, case-insensitively unless stated:

- ``session`` / ``sessions`` as a word (``this session``, ``the fifth session``,
  ``twenty-third session``, ``session lead``), except in technical compounds that name a
  tool's own session (``CUPTI session``, ``profiler session``, ``tmux session``, ...) and code
  identifiers (``session.run``, ``session=``, ``session_id``, ``tf.Session(``);
- run tags of the form ``_s21`` / ``_s9b`` (lower case) that end a name part, as in
  ``decode_quick_s21_mm.json``, and ``(s21)`` / ``s21:`` in prose (Markdown only).

Not checked: binary files, and the files that must spell the wording out: this checker and its
tests' fixtures (``EXEMPT``).

    python tools/check_wording.py            # every tracked text file; exit status 1 on a hit
    python tools/check_wording.py FILE ...   # only these files (relative to the current folder)

From the repository root.

>>> [m.group(0) for m in find("the fifth session measured it", "x.md")]
['fifth session']
>>> find("before any CUPTI session starts", "x.py")
[]
>>> [m.group(0) for m in find("see decode_quick_s21_mm.json", "x.py")]
['_s21']
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

EXEMPT = frozenset({"tools/check_wording.py", "tests/test_check_wording.py"})

_ORDINAL = (
    r"(?:(?:twenty|thirty)-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|"
    r"tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|"
    r"eighteenth|nineteenth|twentieth|thirtieth)|\d+(?:st|nd|rd|th)"
)
# A tool's own session: allowed words right before "session".
_TOOL = r"cupti|profiler|profiling|tmux|ssh|http|login|interactive|browser|tensorflow|tf"
SESSION = re.compile(
    rf"(?<![\w.])(?:(?:{_ORDINAL})(?:\s+and\s+(?:{_ORDINAL}))?\s+)?sessions?\b(?!\(|_|=|\.\w)",
    re.IGNORECASE,
)
_TOOL_BEFORE = re.compile(rf"(?:{_TOOL})[\s-]+$", re.IGNORECASE)
RUN_TAG = re.compile(r"_s\d{1,2}[a-z]?(?=[_.\-]|\b)")
PROSE_TAG = re.compile(r"(?<![\w/.-])s\d{1,2}[a-z]?(?=[):;]|\s+(?:call|run|results?)\b)")


def find(text: str, path: str) -> list[re.Match]:
    """The history wording in ``text`` (the contents of ``path``), in order."""
    hits = []
    for m in SESSION.finditer(text):
        if not _TOOL_BEFORE.search(text[max(0, m.start() - 20) : m.start()]):
            hits.append(m)
    hits += RUN_TAG.finditer(text)
    if path.endswith(".md"):
        hits += PROSE_TAG.finditer(text)
    return sorted(hits, key=lambda m: m.start())


def tracked_files(root: pathlib.Path) -> list[str]:
    """Every file git tracks under ``root`` (relative paths)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def check(root: pathlib.Path, paths: list[str]) -> list[str]:
    """``path:line: match`` for every hit in ``paths`` (relative to ``root``)."""
    problems = []
    for rel in paths:
        if rel in EXEMPT:
            continue
        path = root / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        for m in find(text, rel):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{rel}:{line}: {m.group(0)!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = pathlib.Path.cwd()  # the repository root (``make lint`` runs there)
    paths = argv or tracked_files(root)
    problems = check(root, paths)
    for p in problems:
        print(p)
    if problems:
        print(
            f"{len(problems)} history wording hit(s): say what is, not when it was found "
            "(history goes in commit messages and docs/perf_history.md)",
            file=sys.stderr,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
