"""Dumping what the backend saw, one folder per compiled frame.

``dump_dir=`` (backend option) or ``LOCALMAP_FX_DUMP_DIR`` turns it on::

    <dump_dir>/rank0-frame0-0/          one folder per compiled frame (rank, Dynamo compile id)
        captured_graph.txt              the graph Dynamo gave the backend
        region_0.txt ...                each region: header (RegionSpec, call site) + body at local shapes
        pass_<name>.txt                 the graph after each stage that rewrites it
        lowered_graph.txt               what the inner compiler received (a frame split
                                        into layers: the graph cut into its pieces)
        aot_forward.txt                 AOTAutograd forward graph   (inner = aot_eager / inductor)
        aot_backward.txt                AOTAutograd backward graph  (written at the first backward)
        inductor_forward.txt ...        where Inductor wrote the generated code (inner = inductor)
        summary.json, summary.md        region and collective tables

The same artifacts go to ``torch._logging.trace_structured`` when
``TORCH_TRACE`` is set, whether or not a folder is written.

Note: [Safe writing]
    File names are fixed by this module (stage names are sanitised, region
    files are numbered): nothing from graph content becomes a path.  A frame
    folder is created with ``os.mkdir`` (never reused: an existing name gets a
    ``.1``, ``.2`` suffix), so files of an earlier run or another process are
    never overwritten.  Every file is written to a temporary name in the same
    folder and moved into place with ``os.replace``, so a reader never sees a
    half-written file; a name this dumper did not create is never replaced.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ..compiler.observe import Observer
from ..errors import region_error
from ..region import META_REGION_ID, find_regions
from . import logs, report, tables
from .atomic import atomic_write
from .collectives import collective_rows
from .region_graph import region_graph

__all__ = ["ENV_VAR", "DumpDirError", "resolve_dump_dir", "FrameFolder", "FrameInspector", "inspector_for"]

ENV_VAR = "LOCALMAP_FX_DUMP_DIR"
FORMAT = "localmap_fx.dump/1"

_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")


class DumpDirError(OSError):
    """The dump folder cannot be created or written."""


def resolve_dump_dir(option: str | os.PathLike | None) -> str | None:
    """The folder to dump into: the option, else ``$LOCALMAP_FX_DUMP_DIR``, else None."""
    if option is not None:
        path = os.fspath(option)
    else:
        path = os.environ.get(ENV_VAR, "")
    return os.path.abspath(os.path.expanduser(path)) if path else None


def _not_writable(root: str, err: BaseException) -> DumpDirError:
    return DumpDirError(
        f"localmap_fx cannot write its dump to {root!r}: {err}. Point dump_dir= (or "
        f"${ENV_VAR}) at a folder you can write, or unset it to turn dumping off."
    )


class FrameFolder:
    """A fresh folder ``root/name`` that only this object writes into."""

    def __init__(self, root: str, name: str) -> None:
        if not _SAFE_FILE.match(name):
            raise ValueError(f"unsafe dump folder name {name!r}")
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise _not_writable(root, e) from e
        if not os.path.isdir(root):
            raise _not_writable(root, NotADirectoryError("not a directory"))
        self.root = root
        for k in range(1000):
            candidate = name if k == 0 else f"{name}.{k}"
            path = os.path.join(root, candidate)
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except OSError as e:
                raise _not_writable(root, e) from e
            self.name, self.path = candidate, path
            break
        else:
            raise _not_writable(root, FileExistsError(f"{name}.1 ... {name}.999 all exist"))
        self._owned: set[str] = set()

    def write(self, filename: str, text: str) -> str:
        """Write ``text`` to ``filename`` inside the folder, atomically."""
        if not _SAFE_FILE.match(filename) or os.sep in filename or "/" in filename:
            raise ValueError(f"unsafe dump file name {filename!r}")
        final = os.path.join(self.path, filename)
        if filename not in self._owned and os.path.lexists(final):
            raise DumpDirError(f"refusing to overwrite {final!r}: localmap_fx did not create it")
        try:
            atomic_write(final, text.encode("utf-8"))
        except OSError as e:
            raise _not_writable(self.path, e) from e
        self._owned.add(filename)
        return final


def _frame_name() -> str:
    from .._torch_compat import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is not None and cid.frame_id is not None:
        name = f"frame{cid.frame_id}-{cid.frame_compile_id}"
        if getattr(cid, "compiled_autograd_id", None) is not None:
            name = f"ca{cid.compiled_autograd_id}-{name}"
    else:
        name = "frame"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        name = f"rank{dist.get_rank()}-{name}"
    return name


def _stage_file(stage: str) -> str:
    return "pass_" + (re.sub(r"[^A-Za-z0-9_]", "_", stage)[:60] or "unnamed") + ".txt"


def _graph_file(stage: str) -> str:
    return {"captured": "captured_graph.txt", "lowered": "lowered_graph.txt"}.get(stage) or _stage_file(stage)


_FILE_DOC = {
    "captured_graph.txt": "the graph Dynamo captured (DTensor level, regions annotated)",
    "lowered_graph.txt": "the graph handed to the inner compiler",
    "aot_forward.txt": "AOTAutograd forward graph (local tensors, functional collectives)",
    "aot_backward.txt": "AOTAutograd backward graph",
    "summary.json": "machine-readable tables (this file's data)",
    "summary.md": "this file",
}


class FrameInspector(Observer):
    """Collects one compiled frame's graphs and tables; writes them to its sinks.

    An :class:`~localmap_fx.compiler.observe.Observer` of the pipeline.
    Sinks: a :class:`FrameFolder` (``folder``, optional), the structured trace
    (``TORCH_TRACE``) and the ``localmap_fx_regions`` log artifact.
    """

    # its collective table and files read the AOT graphs
    wants_aot_graphs = True

    def __init__(self, inner: str, folder: FrameFolder | None, frame: str) -> None:
        self.inner = inner
        self.folder = folder
        self.summary: dict[str, Any] = {
            "format": FORMAT,
            "frame": frame,
            "inner": inner,
            "regions": [],
            "redistributes": [],
            "collectives": {},
            "aot_graphs": [],
            "graph": {"nodes": [], "edges": []},
            "inner_outputs": {},
            "files": {},
            "errors": [],
        }
        self._groups: dict[str, dict] = {}
        self._region_texts: list[str] = []
        self._have_lowered_rows = False
        self._counts: dict[str, int] = {}

    # -- sinks ----------------------------------------------------------------

    def _emit(self, filename: str, text: Callable[[], str], what: str, encoding: str = "string") -> None:
        cache: list[str] = []

        def payload() -> str:
            if not cache:
                cache.append(text())
            return cache[0]

        logs.trace_artifact(filename.rsplit(".", 1)[0], payload, encoding)
        if self.folder is not None:
            self.folder.write(filename, payload())
            self.summary["files"][filename] = what

    def _write_summary(self, trace: bool) -> None:
        if self.folder is not None:
            self.summary["files"].setdefault("summary.json", _FILE_DOC["summary.json"])
            self.summary["files"].setdefault("summary.md", _FILE_DOC["summary.md"])
            self.folder.write("summary.json", json.dumps(self.summary, indent=1, default=str) + "\n")
            self.folder.write("summary.md", report.summary_markdown(self.summary))
        if trace:
            logs.trace_artifact("summary", lambda: json.dumps(self.summary, default=str), "json")
            logs.trace_artifact("summary_md", lambda: report.summary_markdown(self.summary))

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        """Run one dump step; a bug in it is reported, not fatal to compilation."""
        try:
            fn()
        except DumpDirError:
            raise
        except Exception as e:  # noqa: BLE001 - dumping must not break compilation
            msg = f"{what}: {type(e).__name__}: {e}"
            self.summary["errors"].append(msg)
            warnings.warn(f"localmap_fx dump: {msg}", stacklevel=2)

    # -- the Observer's hooks ------------------------------------------------------

    def stage(self, name: str, gm: fx.GraphModule) -> None:
        self._guard(f"stage {name}", lambda: self._stage(name, gm))
        self._write_summary(trace=False)

    def _stage(self, name: str, gm: fx.GraphModule) -> None:
        fname = _graph_file(name)
        what = _FILE_DOC.get(fname, f"the graph after the {name} pass")
        self._emit(fname, lambda: tables.graph_text(gm), what)
        regions = find_regions(gm)
        if name == "captured":
            self._groups = tables.mesh_groups(gm, regions)
            self.summary["groups"] = self._groups
            self.summary["regions"] = tables.region_rows(gm, regions)
            self._region_texts = []
            for k, r in enumerate(regions):
                text = tables.region_text(f"r{k}", r)
                self._region_texts.append(text)
                self._emit(
                    f"region_{k}.txt",
                    _constant(text),
                    f"region r{k} ({r.spec.func}): spec, call site, body at local shapes",
                )
        elif not self._have_lowered_rows and tables.is_lowered(gm):
            # First graph with explicit boundaries, before fuse_boundaries drops
            # any of them: grad placements, plans and data flow are all there.
            self.summary["regions"] = tables.region_rows(gm, regions)
            self.summary["redistributes"] = tables.plan_rows(gm, regions)
            self.summary["graph"] = region_graph(gm, regions)
            self._have_lowered_rows = True
            tag_regions(regions)

    def lowered(self, gm: fx.GraphModule) -> None:
        """The graph the inner compiler receives (after every rewrite), or the one cut into pieces."""
        self._guard("lowered graph", lambda: self._emit("lowered_graph.txt", lambda: tables.graph_text(gm), _FILE_DOC["lowered_graph.txt"]))
        logs.log_regions(self._regions_log_text)
        self._write_summary(trace=True)

    def layers(self, plan, decision, pieces) -> None:
        """Which layers share one compiled piece (see localmap_fx.layer_sharing)."""
        self._guard("pieces", lambda: self.summary.__setitem__(
            "pieces", tables.piece_rows(plan, pieces, decision.why_whole)))
        self._write_summary(trace=True)

    def border(self, text: str) -> None:
        """The lean DTensor border of the graph compiled whole, and its tangent plan (or why not)."""
        self._guard("border", lambda: self.summary.__setitem__("border", text))
        self._write_summary(trace=False)

    def aot_graph(self, kind: str, gm: fx.GraphModule) -> None:
        def step() -> None:
            n = self._counts.get(kind, 0)
            self._counts[kind] = n + 1
            suffix = "" if n == 0 else f"_{n}"
            self._emit(f"aot_{kind}{suffix}.txt", lambda: tables.graph_text(gm), _FILE_DOC.get(f"aot_{kind}.txt", f"AOT {kind} graph"))
            rows = collective_rows(kind, gm, self.summary["regions"], self._groups)
            self.summary["collectives"].setdefault(kind, []).extend(rows)
            if kind not in self.summary["aot_graphs"]:
                self.summary["aot_graphs"].append(kind)

        self._guard(f"AOT {kind} graph", step)
        self._write_summary(trace=True)

    def inner_output(self, kind: str, compiled: Any) -> None:
        """A pointer to what the inner compiler produced (Inductor's code file)."""

        def step() -> None:
            path = _generated_code_path(compiled)
            key = getattr(compiled, "cache_key", None)
            if path is None and key is None:
                return
            text = (
                f"Inductor {kind} code for frame {self.summary['frame']}\n"
                f"generated code: {path or 'unknown'}\n"
                f"cache key: {key or 'unknown'}\n"
                "(TORCH_LOGS=output_code prints it; the file lives in Inductor's cache.)\n"
            )
            fname = f"inductor_{kind}.txt"
            self._emit(fname, lambda: text, f"where Inductor wrote the {kind} code")
            self.summary["inner_outputs"][kind] = path

        self._guard(f"inner {kind} output", step)
        self._write_summary(trace=False)

    def _regions_log_text(self) -> str:
        head = f"localmap_fx regions of frame {self.summary['frame']}:\n"
        table = "\n".join(report.region_table(self.summary["regions"])) if self.summary["regions"] else "(none)"
        return head + table + "\n\n" + "\n".join(self._region_texts)


def _constant(text: str) -> Callable[[], str]:
    return lambda: text


def tag_regions(regions) -> None:
    """Add ``localmap_fx.region_id`` ("r0", "r1", ...) to each region's nodes.

    AOTAutograd copies ``node.meta["custom"]`` into the forward and backward
    nodes it derives, so a collective can then be tied to one call even when
    several calls share a function and a source line (a loop of layers).
    Only metadata changes (not in any cache key; see docs/debugging.md).
    """
    for k, region in enumerate(regions):
        for node in (*region.enter_nodes, *region.body_nodes, *region.exit_nodes):
            custom = node.meta.get("custom")
            if custom:
                node.meta["custom"] = {**custom, META_REGION_ID: f"r{k}"}


def _generated_code_path(compiled: Any) -> str | None:
    fn = getattr(compiled, "current_callable", None)
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is not None and os.path.isfile(code.co_filename):
        return code.co_filename
    import sys

    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(mod, "__file__", None)
    return path if path and os.path.isfile(path) else None


def inspector_for(opts) -> FrameInspector | None:
    """The inspector for one compiled frame, or None when nothing asks for it.

    Raises (at compile time) when the dump folder cannot be written.
    """
    root = resolve_dump_dir(getattr(opts, "dump_dir", None))
    if root is None and not logs.tracing() and not logs.regions_logging():
        return None
    frame = _frame_name()
    folder = None
    if root is not None:
        try:
            folder = FrameFolder(root, frame)
        except DumpDirError as e:
            raise region_error(e, f"the dump folder option (dump_dir= / ${ENV_VAR})") from e
        frame = folder.name
    return FrameInspector(opts.inner, folder, frame)
