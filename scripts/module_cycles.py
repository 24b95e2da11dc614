#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

Twice: between a crate's top-level modules (`src/foo.rs` or `src/foo/`:
an edge a -> b is any `crate::b` path, or `use crate::{b, ..}`, in a's
non-test code), and between its files (every module file is a node; an
edge a -> b is a `crate::`, `super::` or `self::` path in a's non-test
code naming module b; a child naming its own ancestors is not counted).
A Python package (a folder with `__init__.py`) is checked by file: an edge
a -> b is any import of sibling module b in a, at the top or inside a
function (a lazy import still runs a's code into b's); the package's own
`__init__` is the root that composes the rest, so a module importing the
package itself is not counted.
Prints every circle found and exits 1; silent and 0 otherwise.
Usage: module_cycles.py CRATE_SRC_DIR_OR_PYTHON_PACKAGE...
"""
import ast
import re
import sys
from pathlib import Path

PATH = re.compile(r"\bcrate::(\w+)")
GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)


def strip_tests(text: str) -> str:
    """Drops the tests module (it comes last); a `#[cfg(test)]` item above
    it stays (its imports are the module's own)."""
    at = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    return text if at is None else text[: at.start()]


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


# File-level circles not yet broken: each is named here until it is
# (none left).
KNOWN: set = set()


def file_modules(src: Path) -> dict:
    """Module path (a tuple) -> its file, tests left out."""
    mods = {}
    for f in sorted(src.rglob("*.rs")):
        rel = list(f.relative_to(src).with_suffix("").parts)
        if rel[-1] in ("mod", "lib", "main"):
            rel = rel[:-1]
        if rel and rel[-1] == "tests":
            continue
        mods[tuple(rel)] = f
    return mods


def resolve(mods: dict, here: tuple, path: str):
    """The deepest module a `crate::`/`super::`/`self::` path names."""
    parts = path.split("::")
    if parts[0] == "crate":
        base, parts = [], parts[1:]
    else:
        base = list(here)
        while parts and parts[0] in ("super", "self"):
            if parts[0] == "super":
                base = base[:-1]
            parts = parts[1:]
    best, cur = None, list(base)
    for p in parts:
        cur = cur + [p]
        if tuple(cur) not in mods:
            break
        best = tuple(cur)
    return best


def file_graph(src: Path) -> dict:
    mods = file_modules(src)
    edges = {}
    for m, f in mods.items():
        text = strip_comments(strip_tests(f.read_text()))
        paths = set(re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", text))
        for pre, grp in re.findall(r"\b((?:crate|super|self)(?:::\w+)*)::\{([^;]*?)\}", text, re.S):
            for part in re.split(r"[,\s{}]+", grp):
                if part and part != "self":
                    paths.add(pre + "::" + part.split("::")[0])
        deps = set()
        for p in paths:
            r = resolve(mods, m, p)
            if r and r != m and m[: len(r)] != r:
                deps.add("::".join(r))
        edges["::".join(m)] = deps
    return edges


def python_graph(package: Path) -> dict:
    """Module name -> the sibling modules it imports (``__init__`` as the
    package's own name)."""
    name = package.name
    mods = {f.stem: f for f in package.glob("*.py")}
    edges = {}
    for stem, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1 or (node.level == 0 and base.split(".")[0] == name):
                    top = base.split(".")[1] if node.level == 0 and "." in base else base.split(".")[0]
                    if node.level == 0 and "." not in base:
                        top = ""
                    if top:
                        deps.add(top)
                    else:  # `from . import a, b`
                        deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == name and len(parts) > 1:
                        deps.add(parts[1])
        edges[stem] = {d for d in deps if d in mods and d not in (stem, "__init__")}
    return edges


def main() -> int:
    bad = 0
    for arg in sys.argv[1:]:
        if (Path(arg) / "__init__.py").exists():
            for cyc in cycles(python_graph(Path(arg))):
                print(f"{arg}: python import circle: {' -> '.join(cyc)}")
                bad += 1
            continue
        for cyc in cycles(graph(Path(arg))):
            print(f"{arg}: module import circle: {' -> '.join(cyc)}")
            bad += 1
        for cyc in cycles(file_graph(Path(arg))):
            known = frozenset(cyc) in KNOWN
            print(f"{arg}: file import circle{' (known, owed)' if known else ''}: {' -> '.join(cyc)}")
            bad += 0 if known else 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
