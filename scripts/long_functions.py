#!/usr/bin/env python3
"""Lists Rust functions longer than a limit (default 80 lines), and source
files longer than a file limit (default 600 lines), tests excluded.

A function runs from its `fn` line to the line of its closing brace, found
by counting braces outside strings, chars and comments (good enough for
this code base's style). Usage: long_functions.py [--max N] [--file-max N] DIR...
Exits 1 when anything is over, except what OWED names (printed as owed),
and when an OWED entry is no longer over (take it off the list).
"""
import re
import sys
from pathlib import Path

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(async\s+)?(unsafe\s+)?(const\s+)?fn\s+(\w+)")


def code_chars(line: str):
    """The line without its string, char literals and `//` comment."""
    out, i, n = [], 0, len(line)
    while i < n:
        c = line[i]
        if line.startswith("//", i):
            break
        if c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and i + 2 < n and (line[i + 2] == "'" or line[i + 1] == "\\"):
            j = line.find("'", i + 2)
            i = j + 1 if j > 0 else n
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path: Path):
    lines = production(path).splitlines()
    i = 0
    while i < len(lines):
        m = FN.match(lines[i])
        if not m:
            i += 1
            continue
        depth, started, j = 0, False, i
        while j < len(lines):
            code = code_chars(lines[j])
            if not started and ";" in code and "{" not in code:
                break  # a declaration without a body
            depth += code.count("{") - code.count("}")
            started = started or "{" in code
            if started and depth <= 0:
                yield m.group(6), i + 1, j - i + 1
                break
            j += 1
        i += 1


# Still over the limits, each owed until it is split; nothing may join
# (none left).
OWED: set = set()


def production(path: Path) -> str:
    """The file up to its test module (tests come last)."""
    text = path.read_text()
    at = text.find("#[cfg(test)]\nmod tests {")
    return text[:at] if at >= 0 else text


def test_module(path: Path) -> bool:
    """Whether the module that declares this file does so under
    `#[cfg(test)]` (a test module of its own file)."""
    decl = re.compile(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod " + re.escape(path.stem) + r";")
    parents = [path.parent.with_suffix(".rs"), path.parent / "mod.rs", path.parent / "lib.rs", path.parent / "main.rs"]
    return any(p.is_file() and decl.search(p.read_text()) for p in parents)


def production_lines(path: Path) -> int:
    return production(path).count("\n")


def main() -> int:
    args = sys.argv[1:]
    limit, file_limit = 80, 600
    if args[:1] == ["--max"]:
        limit, args = int(args[1]), args[2:]
    if args[:1] == ["--file-max"]:
        file_limit, args = int(args[1]), args[2:]
    over, owed_seen = 0, set()

    def report(key: str, text: str) -> None:
        nonlocal over
        if key in OWED:
            owed_seen.add(key)
            print(f"{text} (owed)")
        else:
            print(text)
            over += 1

    for d in args:
        for f in sorted(Path(d).rglob("*.rs")):
            if f.name == "tests.rs" or "tests" in f.parts or test_module(f):
                continue
            rel = str(f)
            n = production_lines(f)
            if n > file_limit:
                report(rel, f"{f}: {n} lines outside tests (limit {file_limit})")
            for name, line, length in functions(f):
                if length > limit:
                    report(f"{rel}:{name}", f"{f}:{line}: fn {name} is {length} lines (limit {limit})")
    for key in sorted(OWED - owed_seen):
        if any(key.startswith(d.rstrip("/") + "/") for d in args):
            print(f"{key} is within the limits now: take it off OWED")
            over += 1
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
