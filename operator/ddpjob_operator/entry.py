"""The ``ddpjob`` console script: a clear message when the operator extra is not installed.

``pip install ddpjob`` installs no dependencies on purpose (a training image wants only
``ddpjob[worker]``), so the command checks that its own are there before it imports them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ddpjob_operator.errors import EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from ddpjob_operator.cli import main as cli_main  # noqa: PLC0415 - the check itself
    except ModuleNotFoundError as exc:
        print(
            f"ddpjob: the {exc.name!r} package is missing. The ddpjob command needs "
            "pip install 'ddpjob[operator]' (add [local] for `ddpjob run`).",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
