"""The repository stands on its own and its docs name only what exists.

- Nothing cites a file outside the repository (a user who clones it has only the repository).
- Code comments keep the why: no diary lines ("round N", dates) that only mean something to
  whoever wrote them.
- Every path and every `Class.member` that ARCHITECTURE.md cites exists in the tree or the proto.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=REPO, capture_output=True, check=True)
    return [REPO / p for p in out.stdout.decode().split("\0") if p and p != THIS]


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
        return ""


def test_no_file_outside_the_repository_is_cited() -> None:
    outside = re.compile(r"\.\./shared|shared/DESIGN|(?<![\w/])DESIGN\.md")
    hits = [f"{p.relative_to(REPO)}:{n}" for p in _tracked() for n, line in enumerate(_text(p).splitlines(), 1)
            if outside.search(line)]
    assert hits == [], f"these lines cite a file a user cloning the repository does not have: {hits}"


_COMMENT = {".py": re.compile(r"#.*$|^\s*[\"']{3}.*|^[^\"']*$"), ".c": re.compile(r"/\*.*|^\s*\*.*|//.*"),
            ".h": re.compile(r"/\*.*|^\s*\*.*|//.*")}
_DIARY = re.compile(r"\bround \d+\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
# A one-off measurement: a throughput figure, or the machine it was taken on. The figures live in
# BENCHMARKS.md with the command and CPU that produced them; a comment says why, and points there.
_MEASUREMENT = re.compile(r"\d ?(GB/s|GFLOP/?s|GFLOPS|tok/s)\b|dev box|\b\d-core (dev|test) (box|machine)"
                          r"|loaded \d-core|\bon (an?|the|this) (loaded )?(AMD |Intel )?(EPYC|Xeon)\b", re.IGNORECASE)


def test_code_comments_carry_no_diary_lines() -> None:
    hits = []
    for path in _tracked("services", "tests", "scripts"):
        comment = _COMMENT.get(path.suffix)
        if comment is None:
            continue
        for n, line in enumerate(_text(path).splitlines(), 1):
            part = comment.search(line)
            if part and (_DIARY.search(part.group(0)) or _MEASUREMENT.search(part.group(0))):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert hits == [], ("comments that date themselves or quote a one-off measurement (say why, not when or how "
                        "fast once; history lives in git, figures in BENCHMARKS.md):\n" + "\n".join(hits))


def _defined_names() -> tuple[set[str], set[str]]:
    """(classes and proto messages, methods/functions and proto fields) defined in the tree."""
    containers, members = set(), set()
    for path in _tracked("services", "proto"):
        text = _text(path)
        containers.update(re.findall(r"^\s*(?:class|message|service)\s+(\w+)", text, re.MULTILINE))
        members.update(re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", text, re.MULTILINE))
        members.update(re.findall(r"^\s*rpc\s+(\w+)", text, re.MULTILINE))
        if path.suffix == ".proto":
            members.update(re.findall(r"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+", text,
                                      re.MULTILINE))
        else:
            members.update(re.findall(r"^\s+(\w+)\s*:", text, re.MULTILINE))
    return containers, members


def test_architecture_names_only_what_exists() -> None:
    doc = (REPO / "ARCHITECTURE.md").read_text()
    files = {p.relative_to(REPO).as_posix() for p in _tracked()}
    dirs = {str(Path(f).parent) + "/" for f in files} | {"services/"}
    containers, members = _defined_names()
    missing = []
    for token in set(re.findall(r"`([^`\s]+)`", doc)):
        if re.fullmatch(r"[\w./-]+\.(py|proto|md|c|h)|[\w./-]+/", token):  # a path
            found = any(f == token or f.endswith("/" + token) for f in files) or \
                any(d == token or d.endswith("/" + token) for d in dirs)
            if not found:
                missing.append(token)
        elif m := re.fullmatch(r"([A-Z]\w+)\.(\w+)(?:\(\))?", token):  # Class.member
            if m.group(1) not in containers or m.group(2) not in members:
                missing.append(token)
    assert missing == [], f"ARCHITECTURE.md cites what the tree does not have: {sorted(missing)}"
