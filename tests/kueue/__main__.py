"""``python -m tests.kueue build``: build the Kueue controller if it is missing and print the
directory of ``kueue``; ``python -m tests.kueue crds`` prints the directory of its CRDs.

Run it from the repo root in the dev venv; next to a test run, lower its priority:

    nice -n 19 .venv/bin/python -m tests.kueue build
"""

from __future__ import annotations

import argparse
import sys

from tests.kueue import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kueue")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build sigs.k8s.io/kueue/cmd/kueue (hack/kueue)")
    sub.add_parser("crds", help="print the directory of Kueue's CRD bases")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build.build())
        else:
            print(build.crd_bases())
    except build.BuildError as exc:
        print(f"tests.kueue: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
