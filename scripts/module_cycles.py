#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

Each crate's top-level modules (`src/foo.rs` or `src/foo/`) are nodes; an
edge a -> b is any `crate::b` path (or `use crate::{b, ..}`) written in a's
non-test code. Prints every circle found and exits 1; silent and 0 otherwise.
Usage: module_cycles.py CRATE_SRC_DIR...
"""
import re
import sys
from pathlib import Path

PATH = re.compile(r"\bcrate::(\w+)")
GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)


def strip_tests(text: str) -> str:
    """Drops everything from the first `#[cfg(test)]` on (tests come last)."""
    at = text.find("#[cfg(test)]")
    return text if at < 0 else text[:at]


def strip_comments(text: str) -> str:
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def reexports(src: Path) -> dict:
    """Names the crate root re-exports (`pub use m::{A, B}`), by module."""
    names = {}
    for root in ("lib.rs", "main.rs"):
        f = src / root
        if not f.exists():
            continue
        for m, body in re.findall(r"pub use (\w+)::\{?([^;]*?)\}?;", f.read_text(), re.S):
            for part in body.split(","):
                name = part.strip().split(" as ")[-1].split("::")[-1].strip()
                if name:
                    names[name] = m
    return names


def graph(src: Path) -> dict:
    edges = {}
    alias = reexports(src)
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).parts
        if rel[-1] in ("tests.rs", "lib.rs", "main.rs") and len(rel) == 1:
            continue
        if rel[-1] == "tests.rs":
            continue
        top = rel[0].removesuffix(".rs")
        text = strip_comments(strip_tests(f.read_text()))
        deps = set(PATH.findall(text))
        for group in GROUP.findall(text):
            for part in group.split(","):
                name = part.strip().split("::")[0].split(" ")[0].strip("{} \n")
                if name:
                    deps.add(name)
        deps = {alias.get(d, d) for d in deps}
        deps.discard(top)
        deps.discard("self")
        edges.setdefault(top, set()).update(deps)
    return {a: {b for b in bs if b in edges} for a, bs in edges.items()}


def cycles(edges: dict) -> list:
    found, seen = [], set()
    def walk(node, path):
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cyc = path[path.index(nxt):]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    found.append(cyc + [nxt])
            elif len(path) < 12:
                walk(nxt, path + [nxt])
    for start in sorted(edges):
        walk(start, [start])
    return found


def main() -> int:
    bad = 0
    for arg in sys.argv[1:]:
        for cyc in cycles(graph(Path(arg))):
            print(f"{arg}: module import circle: {' -> '.join(cyc)}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
