"""Developer commands: python -m mstbuild {fetch,workspace,patches,rebase} (see `make help`)."""

import argparse
import sys

from . import core, series


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mstbuild", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download (or take $MST_UPSTREAM_WHEEL) and verify the pinned upstream wheel; print its path")
    ws = sub.add_parser("workspace", help="materialize work/pristine and work/patched (git patch stack)")
    ws.add_argument("--force", action="store_true", help="discard an existing work/ directory")
    sub.add_parser("patches", help="regenerate patches/*.patch and patches/series from work/patched")
    rb = sub.add_parser("rebase", help="rebuild work/ on another upstream release; if all patches apply, "
                        "regenerate the series and pin, build, install into a scratch venv, test; one report")
    rb.add_argument("--upstream", required=True, help="upstream version, e.g. 5.22.0")
    rb.add_argument("--sha256", required=True, help="sha256 of that release's py3-none-any wheel")
    rb.add_argument("--force", action="store_true", help="discard an existing work/ directory")
    rb.add_argument("--no-test", action="store_true", help="stop after regenerating the series (no build, no tests)")
    rb.add_argument("--pytest-args", default="tests", help="what pytest runs (default: tests)")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(series.cached_wheel(core.Pin.load()))
        elif args.command == "workspace":
            series.workspace(force=args.force)
        elif args.command == "patches":
            series.refresh()
        elif args.command == "rebase":
            ok = series.rebase(args.upstream, args.sha256, force=args.force, test=not args.no_test,
                               pytest_args=args.pytest_args.split())
            return 0 if ok else 1
    except core.BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
