"""``localmap-fx inspect DIR`` (also ``python -m localmap_fx inspect DIR``).

DIR is one frame's folder (it holds ``summary.json``) or a dump folder
holding several.  Prints the region and collective tables; ``--svg OUT``
draws the region graph with Graphviz, ``--dot OUT`` writes its DOT text,
``--diff DIR2`` lists what changed between two dumps.

Exit status: 0 success (and, with ``--diff``, no difference), 1 the dumps
differ, 2 bad usage or unreadable dump, 3 Graphviz missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "load_dump"]

_MARKER = b"localmap_fx"


class DumpError(Exception):
    pass


def load_dump(path: str) -> dict[str, dict]:
    """Frame name -> summary for a frame folder or a folder of frame folders."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a folder")
    one = os.path.join(path, "summary.json")
    if os.path.isfile(one):
        return {os.path.basename(path): _read(one)}
    frames = {}
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name, "summary.json")
        if os.path.isfile(f):
            frames[name] = _read(f)
    if not frames:
        raise DumpError(
            f"{path}: no summary.json here or in its sub-folders; dump with "
            "LOCALMAP_FX_DUMP_DIR=DIR or backend(dump_dir=DIR) first"
        )
    return frames


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise DumpError(f"{path}: cannot read: {e}") from e
    fmt = data.get("format", "")
    if not str(fmt).startswith("localmap_fx.dump/"):
        raise DumpError(f"{path}: not a localmap_fx dump summary (format {fmt!r})")
    return data


def _pick(frames: dict[str, dict], name: str | None) -> tuple[str, dict]:
    if name is not None:
        if name not in frames:
            raise DumpError(f"no frame {name!r}; frames: {', '.join(frames)}")
        return name, frames[name]
    if len(frames) > 1:
        raise DumpError(f"the dump holds {len(frames)} frames ({', '.join(frames)}): choose one with --frame")
    return next(iter(frames.items()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localmap-fx", description="Inspect localmap_fx compile dumps.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="print a dump's region and collective tables")
    i.add_argument("dir", help="a frame folder (with summary.json) or a dump folder")
    i.add_argument("--frame", help="the frame to use when DIR holds several")
    i.add_argument("--svg", metavar="OUT", help="draw the region graph to OUT (needs Graphviz's dot)")
    i.add_argument("--dot", metavar="OUT", help="write the region graph as DOT text to OUT")
    i.add_argument("--diff", metavar="DIR2", help="compare with another dump")
    i.add_argument("--force", action="store_true", help="overwrite OUT even if localmap-fx did not write it")
    i.add_argument("--quiet", "-q", action="store_true", help="do not print the tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .report import summary_markdown

    try:
        frames = load_dump(args.dir)
        if args.diff is not None:
            from .compare import diff_frames

            lines = diff_frames(frames, load_dump(args.diff))
            print("\n".join(lines) if lines else "no difference in regions or collectives")
            return 1 if lines else 0
        if not args.quiet:
            print("\n".join(summary_markdown(s) for s in frames.values()), end="")
        if args.svg or args.dot:
            from .draw import DotNotFound, render_svg, to_dot, write_new_or_own

            _, summary = _pick(frames, args.frame)
            text = to_dot(summary)
            if args.dot:
                write_new_or_own(args.dot, text.encode(), _MARKER, args.force)
                print(f"wrote {args.dot}", file=sys.stderr)
            if args.svg:
                try:
                    svg = render_svg(text)
                except DotNotFound as e:
                    print(f"localmap-fx: {e}", file=sys.stderr)
                    return 3
                write_new_or_own(args.svg, svg, _MARKER, args.force)
                print(f"wrote {args.svg}", file=sys.stderr)
    except (DumpError, FileExistsError, OSError, RuntimeError) as e:
        print(f"localmap-fx: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
