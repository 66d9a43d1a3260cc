"""``localmap-fx inspect DIR`` (also ``python -m localmap_fx inspect DIR``).

DIR is one frame's folder (it holds ``summary.json``) or a dump folder
holding several.  Prints the region and collective tables; ``--svg OUT`` /
``--png OUT`` draw the region graph (our own layout, no system package;
``--layout graphviz`` uses Graphviz's ``dot`` instead), ``--dot OUT`` writes
its DOT text, ``--diff DIR2`` lists what changed between two dumps.  A
drawing shows one frame: ``--frame NAME``, else the only one, else rank 0's
first (a torchrun dump holds one frame per rank), named on stderr.

Exit status: 0 success (and, with ``--diff``, no difference), 1 the dumps
differ, 2 bad usage or unreadable dump, 3 a renderer is missing (Graphviz
for ``--layout graphviz``, Pillow for ``--png``).

Note: [The CLI imports no torch]
    Only pure-Python modules are imported here (formatting, report, compare,
    draw, layout): reading a dump takes a fraction of a second instead of
    the seconds importing torch costs (``benchmarks/startup.py``, S2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def _frame_order(name: str) -> tuple:
    """Sort key: rank, then Dynamo frame id and compile id (numbers as numbers)."""
    rank = re.match(r"rank(\d+)-", name)
    nums = tuple(int(n) for n in re.findall(r"\d+", name[rank.end() if rank else 0 :]))
    return (int(rank.group(1)) if rank else 0, nums, name)


def _pick(frames: dict[str, dict], name: str | None) -> tuple[str, dict]:
    if name is not None:
        if name not in frames:
            raise DumpError(f"no frame {name!r}; frames: {', '.join(frames)}")
        return name, frames[name]
    if len(frames) > 1:
        chosen = min(frames, key=_frame_order)
        print(
            f"localmap-fx: the dump holds {len(frames)} frames ({', '.join(sorted(frames, key=_frame_order))}); "
            f"drawing {chosen} (rank 0's first); choose another with --frame",
            file=sys.stderr,
        )
        return chosen, frames[chosen]
    return next(iter(frames.items()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localmap-fx", description="Inspect localmap_fx compile dumps.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="print a dump's region and collective tables")
    i.add_argument("dir", help="a frame folder (with summary.json) or a dump folder")
    i.add_argument("--frame", help="the frame to use when DIR holds several")
    i.add_argument("--svg", metavar="OUT", help="draw the region graph as SVG to OUT")
    i.add_argument("--png", metavar="OUT", help="draw the region graph as PNG to OUT (needs Pillow)")
    i.add_argument(
        "--layout",
        choices=("builtin", "graphviz"),
        default="builtin",
        help="who lays out --svg/--png: localmap-fx itself (default) or Graphviz's dot (if installed)",
    )
    i.add_argument("--dot", metavar="OUT", help="write the region graph as DOT text to OUT (for Graphviz)")
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
        if args.svg or args.png or args.dot:
            return _draw(args, *_pick(frames, args.frame))
    except (DumpError, FileExistsError, OSError, RuntimeError) as e:
        print(f"localmap-fx: {e}", file=sys.stderr)
        return 2
    return 0


def _draw(args: argparse.Namespace, frame: str, summary: dict) -> int:
    from .draw import DotNotFound, render_graphviz, to_dot, write_new_or_own
    from .layout import PillowNotFound, layout, to_png, to_svg

    dot_text = to_dot(summary)
    outputs: list[tuple[str, bytes]] = []
    if args.dot:
        outputs.append((args.dot, dot_text.encode()))
    try:
        if args.layout == "graphviz":
            for path, fmt in ((args.svg, "svg"), (args.png, "png")):
                if path:
                    data = render_graphviz(dot_text, fmt)
                    if fmt == "png":  # dot writes no text chunk we could recognise later
                        data = _png_with_marker(data)
                    outputs.append((path, data))
        elif args.svg or args.png:
            from .draw import scene

            picture = layout(scene(summary))
            if args.svg:
                outputs.append((args.svg, to_svg(picture).encode()))
            if args.png:
                outputs.append((args.png, to_png(picture)))
    except (DotNotFound, PillowNotFound) as e:
        print(f"localmap-fx: {e}", file=sys.stderr)
        return 3
    for path, data in outputs:
        write_new_or_own(path, data, _MARKER, args.force)
        print(f"wrote {path} (frame {frame})", file=sys.stderr)
    return 0


def _png_with_marker(png: bytes) -> bytes:
    """``png`` with a tEXt chunk naming localmap_fx, right after the header chunk."""
    import struct
    import zlib

    payload = b"Software\x00" + _MARKER + b" region graph"
    chunk = struct.pack(">I", len(payload)) + b"tEXt" + payload
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + payload) & 0xFFFFFFFF)
    ihdr_end = 8 + 4 + 4 + 13 + 4  # signature, length, type, IHDR data, crc
    return png[:ihdr_end] + chunk + png[ihdr_end:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
