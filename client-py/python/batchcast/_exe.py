"""Where the `batchcast` command (the broker binary) is.

The wheel installs it as a script (``batchcast-X.data/scripts``), so pip
puts it in the install's ``bin`` folder next to ``python``; ``python -m
batchcast`` and code that starts brokers find it with :func:`executable`.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from .errors import BrokerUnavailable

NAME = "batchcast"


def _installed() -> Iterator[Path]:
    """Candidates for the binary installed with this package, best first."""
    # pip's record of what it installed: the script's path relative to
    # site-packages, whatever the scheme (venv, --user, --prefix, --target).
    try:
        from importlib.metadata import distribution

        dist = distribution(NAME)
        for f in dist.files or ():
            if f.name == NAME and f.parent.name in ("bin", "scripts", "Scripts"):
                yield Path(str(dist.locate_file(f))).resolve()
    except Exception:  # no metadata: running from a source tree
        pass
    # The scheme whose library folder holds this package.
    here = Path(__file__).resolve().parent.parent
    for scheme in sysconfig.get_scheme_names():
        try:
            paths = sysconfig.get_paths(scheme)
        except (KeyError, ValueError):
            continue
        libs = {paths.get("purelib"), paths.get("platlib")}
        if str(here) in libs and paths.get("scripts"):
            yield Path(paths["scripts"]) / NAME


def executable(required: bool = True) -> Optional[str]:
    """The `batchcast` command this package should run.

    In order: ``$BATCHCAST_BIN``; the binary the wheel installed with this
    package; ``batchcast`` on ``PATH``. Raises :class:`BrokerUnavailable`
    naming where it looked when there is none (``required=False``: returns
    ``None``).
    """
    env = os.environ.get("BATCHCAST_BIN")
    if env:
        if Path(env).is_file() and os.access(env, os.X_OK):
            return env
        if required:
            raise BrokerUnavailable(f"BATCHCAST_BIN={env} is not an executable file")
        return None
    for p in _installed():
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which(NAME)
    if found:
        return found
    if required:
        raise BrokerUnavailable(
            "no `batchcast` command: the installed package has no broker binary and none is on PATH. "
            "Install a wheel (pip install batchcast-*.whl, which carries it), build it "
            "(cargo install --path broker), or set BATCHCAST_BIN to its path"
        )
    return None
