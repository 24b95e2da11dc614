#!/usr/bin/env python3
"""Fails when ARCHITECTURE.md's module map ("Where things are") leaves out a
module file of a crate.

Each crate's section of the map starts at the line naming its source
folder (`client-rs/src/`, `broker/src/`, ...) and runs to the next
unindented line. A file `src/a/b/c.rs` must be named there: `c.rs`
after the first mention of its folder `b/` (or of `b.rs`, whose
submodules live in `b/`); a top-level `c.rs` anywhere in the section.
`mod.rs`, `lib.rs`, `main.rs` and `tests.rs` are named by their folder.
Usage: module_map.py [ARCHITECTURE.md]
"""
import re
import sys
from pathlib import Path

CRATES = ["client-rs/src", "broker/src", "client-py/src", "bench/src"]
SKIP = {"mod.rs", "lib.rs", "main.rs", "tests.rs"}


def section(text: str, folder: str) -> str:
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith(folder + "/") or l.startswith(folder.split("/")[0] + "/")), None)
    if start is None:
        return ""
    out = [lines[start]]
    for l in lines[start + 1:]:
        if l and not l.startswith(" "):
            break
        out.append(l)
    return "\n".join(out)


def named(sec: str, rel: Path) -> bool:
    name = rel.name
    word = re.compile(r"(?<![\w])" + re.escape(name) + r"\b")
    if len(rel.parts) == 1:
        return bool(word.search(sec))
    parent = rel.parts[-2]
    at = min((m.start() for m in re.finditer(r"(?<![\w])" + re.escape(parent) + r"(/|\.rs)", sec)), default=None)
    if at is None:
        return False
    return bool(word.search(sec, at))


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    arch = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "ARCHITECTURE.md"
    text = arch.read_text()
    text = text[text.index("## Where things are"):]
    text = text[: text.index("```", text.index("```") + 3)]
    missing = []
    for crate in CRATES:
        sec = section(text, crate)
        for f in sorted((root / crate).rglob("*.rs")):
            rel = f.relative_to(root / crate)
            if rel.name in SKIP or "tests" in rel.parts:
                continue
            if not sec or not named(sec, rel):
                missing.append(f"{crate}/{rel}")
    for m in missing:
        print(f"{arch.name}: the module map does not name {m}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
