"""``python -m batchcast ARGS``: runs the `batchcast` command (the broker
binary installed with this package) with ARGS, in place of this process."""

import os
import sys

from ._exe import executable
from .errors import BrokerUnavailable


def main() -> None:
    try:
        exe = executable()
    except BrokerUnavailable as e:
        sys.exit(f"batchcast: {e}")
    os.execv(exe, ["batchcast", *sys.argv[1:]])


if __name__ == "__main__":
    main()
