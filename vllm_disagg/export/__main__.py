"""``python -m vllm_disagg.export`` / ``vllm-disagg-export``.

    vllm-disagg-export [--sdist PATH | --vllm-src DIR] (--out DIR | --check PATH)
                       [--author 'Name <email>']

``--out DIR`` becomes a git repository (branch ``vllm-disagg``): the pinned
source as released, then one signed-off commit per upstream pull request;
``DIR-patches/`` holds their ``git format-patch`` files and a pull-request
description per commit.

With neither ``--sdist`` nor ``--vllm-src`` it uses the pinned sdist in the
cache (``$VLLM_DISAGG_CACHE``, else ``~/.cache/vllm-disagg``), downloading it
with pip on first use. ``--check`` is a dry run against another release's
sdist or source tree. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_disagg.export.drift import check_report
from vllm_disagg.export.source import (
    ExportError,
    Pin,
    cache_dir,
    pinned_sdist,
    read_source,
    verify,
)
from vllm_disagg.export.tree import BRANCH, Identity, build

PROG = "vllm-disagg-export"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Generate an in-tree vLLM fork carrying this project's patch set from the "
            "pinned upstream source."
        ),
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--sdist", type=Path, metavar="PATH", help="the pinned vLLM sdist"
    )
    source.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        help="a source tree of the pinned vLLM (an extracted sdist or a git checkout)",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where to write the fork (must not exist)",
    )
    action.add_argument(
        "--check",
        type=Path,
        metavar="PATH",
        help="dry run: how another release's sdist or source tree differs from the pin",
    )
    parser.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        help="who signs off the commits (default: git config user.name/user.email)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="where the downloaded sdist is kept (default: %(default)s)",
        default=cache_dir(),
    )
    return parser


def run(args: argparse.Namespace) -> int:
    if args.out is not None and (args.out.exists() or args.out.is_symlink()):
        raise ExportError(
            f"--out {args.out} exists; give a directory that does not exist yet"
        )
    pin = Pin.current()
    if args.check is not None:
        # The pinned side of the comparison: the given source (verified),
        # else the installed wheel's pinned files (checked by hash).
        pinned = None
        if args.sdist or args.vllm_src:
            pinned = read_source(args.sdist or args.vllm_src, pin.files)
            print("\n".join(verify(pinned, pin)))
        print("\n".join(check_report(args.check, pinned, pin)))
        return 0
    identity = Identity.parse(args.author) if args.author else Identity.from_git()
    if identity is None:
        raise ExportError(
            "no one to sign off the commits: pass --author 'Name <email>' "
            "or set git config user.name and user.email"
        )
    path = args.sdist or args.vllm_src or pinned_sdist(args.cache_dir, pin)
    source = read_source(path, pin.files)
    print("\n".join(verify(source, pin)))
    result = build(source, args.out, identity)
    for commit, sha, changed in result.commits:
        print(f"{sha[:12]} {commit.title} ({len(changed)} files)")
    print(f"fork: {result.out} (branch {BRANCH}); patches: {result.patches_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ExportError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
