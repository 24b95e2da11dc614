#!/usr/bin/env python3
"""Counts the methods of a type (over every `impl` block of its crate) and
the fields of a struct, and fails where one is over its limit; fails where
the stream's ledger (CLOCKLESS) reads a clock.

The types checked and their limits are LIMITS below: the ones every new
feature lands in, kept split by owner instead of growing. OWED names a
type still over its limit (printed as owed, not failed) until it is split;
an OWED entry that is no longer over fails too (take it off the list).
Usage: type_sizes.py [--all]   (--all: print every count, not only problems)
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (crate source folder, type name, file of its struct): method and field
# limits (None: not limited). Stream's state is its Inner's.
LIMITS = [
    ("broker/src", "Stream", "broker/src/stream/mod.rs", 20, None),
    ("broker/src", "Inner", "broker/src/stream/mod.rs", None, 8),
    ("client-rs/src", "Consumer", "client-rs/src/consumer.rs", 20, 8),
]
# The stream's ledger (issue 71): every struct of these files is one owner
# of the stream's decisions, at most LEDGER_LIMITS methods and fields.
LEDGER = ["broker/src/hub.rs", "broker/src/hub", "broker/src/stream"]
LEDGER_LIMITS = (25, 12)
# The ledger's parts that read no clock: time is an argument (`now`), so
# their rules are tested on a simulated clock.
CLOCKLESS = [
    "broker/src/hub.rs",
    "broker/src/hub",
    "broker/src/stream/hold.rs",
    "broker/src/stream/hold/round.rs",
    "broker/src/stream/merge.rs",
    "broker/src/stream/decouple.rs",
    "broker/src/stream/rotate.rs",
    "broker/src/stream/replay/book.rs",
    "broker/src/stream/autoscale.rs",
]
CLOCK = re.compile(r"Instant::now\(\)|SystemTime|\.elapsed\(\)")


def clock_reads() -> list:
    """`file:line: text` of every clock read in CLOCKLESS' production code."""
    found = []
    for entry in CLOCKLESS:
        path = ROOT / entry
        for f in sorted(path.rglob("*.rs")) if path.is_dir() else [path]:
            if f.name in ("tests.rs", "mixed.rs"):
                continue
            for k, line in enumerate(production(f.read_text()).splitlines(), 1):
                if CLOCK.search(line.split("//")[0]):
                    found.append(f"{f.relative_to(ROOT)}:{k}: {line.strip()}")
    return found


# Types over a limit today, owed a split (issue 71: the ledger by owner):
# (file of the struct, "Type", "methods" | "fields").
OWED: set = set()


def ledger_types() -> list:
    """(crate source folder, name, file, method limit, field limit) for
    every struct declared in LEDGER's files."""
    files = []
    for entry in LEDGER:
        path = ROOT / entry
        files += sorted(path.rglob("*.rs")) if path.is_dir() else [path]
    found = []
    for f in files:
        if f.name == "tests.rs":
            continue
        for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?struct\s+(\w+)", production(f.read_text()), re.M):
            found.append(("broker/src", m.group(1), str(f.relative_to(ROOT)), *LEDGER_LIMITS))
    return found


def production(text: str) -> str:
    at = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+tests\s*\{", text)
    return text if at is None else text[: at.start()]


def block(text: str, start: int) -> str:
    """The `{ ... }` block opening at or after `start` (braces counted)."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return text[i + 1 :]


def methods(src: Path, name: str, home: Path) -> int:
    """`fn`s at the top level of every inherent `impl Name` block in the
    files under `src` whose module can see the type (its own file and the
    folder beside it)."""
    impl = re.compile(r"^\s*impl(?:<[^>]*>)?\s+" + re.escape(name) + r"\b(?:<[^>]*>)?\s*\{", re.M)
    # Its module's folder (a `mod.rs`'s, or the folder beside `x.rs`) and,
    # for a file inside a module's folder, that module's other files too
    # (an owner's impls may sit beside it, as `hub/counts.rs` for `View`).
    own = home.parent if home.name == "mod.rs" else home.with_suffix("")
    scope = [home] + sorted(own.rglob("*.rs"))
    if home.name != "mod.rs" and home.parent != src:
        scope += sorted(home.parent.rglob("*.rs"))
    n = 0
    for f in dict.fromkeys(scope):
        if not f.exists() or f.name == "tests.rs":
            continue
        text = production(f.read_text())
        for m in impl.finditer(text):
            body = block(text, m.start())
            depth = 0
            for line in body.splitlines():
                if depth == 0 and re.match(r"\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s", line):
                    n += 1
                depth += line.count("{") - line.count("}")
    return n


def fields(home: Path, name: str) -> int:
    text = production(home.read_text())
    m = re.search(r"^\s*(pub(\([^)]*\))?\s+)?struct\s+" + re.escape(name) + r"\b[^{;]*\{", text, re.M)
    if not m:
        return 0
    body = block(text, m.start())
    depth, n = 0, 0
    for line in body.splitlines():
        code = line.split("//")[0]
        if depth == 0 and re.match(r"\s*(pub(\([^)]*\))?\s+)?\w+\s*:", code):
            n += 1
        depth += code.count("{") + code.count("(") + code.count("<") - code.count("}") - code.count(")") - code.count(">")
    return n


def main() -> int:
    show = "--all" in sys.argv
    bad = 0
    for read in clock_reads():
        print(f"{read}: reads the clock in the ledger: take `now` as an argument")
        bad += 1
    listed = {(home, name) for _, name, home, _, _ in LIMITS}
    types = LIMITS + [t for t in ledger_types() if (t[2], t[1]) not in listed]
    for src, name, home, max_methods, max_fields in types:
        home_path = ROOT / home
        counts = {"methods": (methods(ROOT / src, name, home_path), max_methods), "fields": (fields(home_path, name), max_fields)}
        for what, (n, limit) in counts.items():
            if limit is None:
                continue
            owed = (home, name, what) in OWED
            over = n > limit
            if over and not owed:
                print(f"{home}: {name} has {n} {what} (limit {limit}): split it by owner")
                bad += 1
            elif owed and not over:
                print(f"{home}: {name} has {n} {what}, within its limit of {limit}: take it off OWED")
                bad += 1
            elif owed or show:
                print(f"{home}: {name} has {n} {what} (limit {limit}){' (owed)' if owed else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
