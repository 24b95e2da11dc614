#!/usr/bin/env python3
"""README stays a front door: at most 250 lines, and every relative link in
it (and in ARCHITECTURE.md) names a file that exists. The docs site's own
links are checked by `mkdocs build --strict`."""

import re
import sys
from pathlib import Path

MAX_LINES = 250


def main():
    root = Path(__file__).resolve().parent.parent
    bad = []
    readme = (root / "README.md").read_text(encoding="utf-8")
    n = readme.count("\n")
    if n > MAX_LINES:
        bad.append(f"README.md has {n} lines (at most {MAX_LINES}: reference text belongs in docs/)")
    for name in ["README.md", "ARCHITECTURE.md"]:
        text = (root / name).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            if not (root / target).exists():
                bad.append(f"{name} links to {target}, which does not exist")
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
