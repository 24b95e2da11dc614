#!/usr/bin/env python3
"""Fails when ARCHITECTURE.md's module map ("Where things are") leaves out a
module file of a crate.

Each crate's section of the map starts at the line naming its source
folder (`client-rs/src/`, `broker/src/`, ...) and runs to the next
unindented line. A file `src/a/b/c.rs` must be named there: `c.rs`
after the first mention of its folder `b/` (or of `b.rs`, whose
submodules live in `b/`); a top-level `c.rs` anywhere in the section.
`mod.rs`, `lib.rs`, `main.rs` and `tests.rs` are named by their folder.

It also checks the map's `[unsafe]` tags against the code: a file with an
`unsafe` block, fn or impl outside its tests must carry the tag after its
own name (before the next name) or after its folder's; and each tag must
follow the name of a file (or a folder) that has one.
Usage: module_map.py [ARCHITECTURE.md]
"""
import re
import sys
from pathlib import Path

CRATES = ["core/src", "client-rs/src", "broker/src", "cli/src", "pixels/src", "client-py/src", "bench/src"]
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


UNSAFE = re.compile(r"\bunsafe\s*(\{|fn\b|impl\b)")
MENTION = re.compile(r"(?<![\w./-])(\w[\w-]*(?:/\w[\w-]*)*(?:\.rs|/))")
TAG = "[unsafe]"


def has_unsafe(f: Path) -> bool:
    text = f.read_text()
    # The tests module (last); a `#[cfg(test)]` item above it is code.
    at = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    text = text if at is None else text[: at.start()]
    code = "\n".join(line.split("//")[0] for line in text.splitlines())
    return bool(UNSAFE.search(code))


def spans(sec: str) -> list:
    """(start, name, text up to the next name) for each name the section mentions."""
    found = [(m.start(), m.group(1)) for m in MENTION.finditer(sec)]
    out = []
    for i, (at, name) in enumerate(found):
        end = found[i + 1][0] if i + 1 < len(found) else len(sec)
        out.append((at, name, sec[at:end]))
    return out


def mention_at(sec: str, rel: Path):
    """Where the map names `rel` (as `named` finds it), or None."""
    name = rel.name
    word = re.compile(r"(?<![\w])" + re.escape(name) + r"\b")
    if len(rel.parts) == 1:
        m = word.search(sec)
        return m.start() if m else None
    parent = rel.parts[-2]
    at = min((m.start() for m in re.finditer(r"(?<![\w])" + re.escape(parent) + r"(/|\.rs)", sec)), default=None)
    if at is None:
        return None
    m = word.search(sec, at)
    return m.start() if m else None


def unsafe_tags(crate: str, sec: str, files: list) -> list:
    problems = []
    unsafe_files = [rel for rel, f in files if has_unsafe(f)]
    sp = spans(sec)

    def tagged_at(at) -> bool:
        return any(a <= at < a + len(t) and TAG in t for a, _, t in sp)

    for rel in unsafe_files:
        own = None if rel.name in SKIP else mention_at(sec, rel)
        folders = [
            m.start()
            for part in rel.parts[:-1]
            for m in re.finditer(r"(?<![\w])" + re.escape(part) + r"/", sec)
        ]
        if not (own is not None and tagged_at(own)) and not any(tagged_at(a) for a in folders):
            problems.append(f"{crate}/{rel} has unsafe code; its entry in the module map needs {TAG}")
    file_names = {rel.name for rel in unsafe_files}
    folder_names = {p + "/" for rel in unsafe_files for p in rel.parts[:-1]}
    for _, name, text in sp:
        last = name.rstrip("/").split("/")[-1]
        ok = last + "/" in folder_names if name.endswith("/") else last in file_names
        if TAG in text and not ok:
            problems.append(f"{crate}: {name} is tagged {TAG} but has no unsafe code")
    return problems


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    arch = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "ARCHITECTURE.md"
    text = arch.read_text()
    text = text[text.index("## Where things are"):]
    text = text[: text.index("```", text.index("```") + 3)]
    missing = []
    for crate in CRATES:
        sec = section(text, crate)
        files = [
            (f.relative_to(root / crate), f)
            for f in sorted((root / crate).rglob("*.rs"))
            if "tests" not in f.relative_to(root / crate).parts and f.name != "tests.rs"
        ]
        missing += unsafe_tags(crate, sec, files)
        for f in sorted((root / crate).rglob("*.rs")):
            rel = f.relative_to(root / crate)
            if rel.name in SKIP or "tests" in rel.parts:
                continue
            if not sec or not named(sec, rel):
                missing.append(f"{crate}/{rel}")
    for m in missing:
        print(f"{arch.name}: " + (m if " " in m else f"the module map does not name {m}"))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
