"""Dumps, summaries, the CLI and the drawing (localmap_fx.debug), one process.

The fake process group makes collectives no-ops, so only graphs matter here;
the pinned summary.md was checked by hand against what the programs do.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points

import pytest
import torch
from expecttest import TestCase
from torch.distributed.tensor import Shard, distribute_tensor

import localmap_fx
from localmap_fx.debug import cli, draw, layout
from localmap_fx.debug.dump import ENV_VAR, DumpDirError, FrameFolder, inspector_for
from localmap_fx.testing.graphs import Recorder, model_sites
from localmap_fx.testing.models import MODELS

from helpers import mesh_for

BASE_FILES = {
    "captured_graph.txt",
    "pass_inline_shared_bodies.txt",
    "pass_lower_boundaries.txt",
    "pass_fuse_boundaries.txt",
    "lowered_graph.txt",
    "summary.json",
    "summary.md",
}
AOT_FILES = {"aot_forward.txt", "aot_backward.txt"}


def _compile(model_name: str, inner: str = "aot_eager", backward: bool = True, **options):
    m = MODELS[model_name]
    state = m.build(mesh_for(m.mesh_ndim), 0)
    loss = torch.compile(m.step, backend=localmap_fx.backend(inner, **options), fullgraph=True)(state)
    if backward:
        loss.backward()
    return state


def _frames(root) -> list[str]:
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


def _only_frame(root) -> str:
    frames = _frames(root)
    assert len(frames) == 1, frames
    return os.path.join(root, frames[0])


def _norm(text: str) -> str:
    return re.sub(r"frame\d+-\d+", "frameN-M", text)


def _run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def redistribute_dump(tmp_path_factory):
    """The `redistribute` model (region with redistribute_inputs=True), aot_eager."""
    root = tmp_path_factory.mktemp("dump_redistribute")
    _compile("redistribute", dump_dir=str(root))
    torch._dynamo.reset()
    return _only_frame(root)


@pytest.fixture(scope="module")
def tp_mlp_dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump_tp_mlp")
    _compile("tp_mlp", dump_dir=str(root))
    torch._dynamo.reset()
    return _only_frame(root)


# --- the dump of a known program ------------------------------------------------


class TestKnownDump(TestCase):
    maxDiff = None

    @pytest.fixture(autouse=True)
    def _dumps(self, redistribute_dump, tp_mlp_dump):
        self.redistribute = redistribute_dump
        self.tp_mlp = tp_mlp_dump

    def test_file_set(self):
        assert set(os.listdir(self.redistribute)) == BASE_FILES | AOT_FILES | {"region_0.txt"}
        assert set(os.listdir(self.tp_mlp)) == BASE_FILES | AOT_FILES | {"region_0.txt", "region_1.txt"}
        assert re.fullmatch(r"rank0-frame\d+-0", os.path.basename(self.tp_mlp))

    def test_region_file_has_header_and_local_body(self):
        with open(os.path.join(self.tp_mlp, "region_1.txt")) as f:
            text = model_sites(f.read())
        assert "# spec:      _row: in=[S(1), S(0)] out=[P] mesh=tp:4" in text
        assert re.search(r"# called at: .*models\.py:_tp_mlp_step\+3 in _tp_mlp_step", text)
        assert 'def forward(self, arg0: "f32[8, 8]", arg1: "f32[8, 16]")' in text

    def test_summary_json_regions_and_collectives(self):
        with open(os.path.join(self.tp_mlp, "summary.json")) as f:
            s = json.load(f)
        assert [r["func"] for r in s["regions"]] == ["_col", "_row"]
        col, row = s["regions"]
        assert [i["grad"] for i in col["inputs"]] == ["P", "S(1)"]
        assert [(o["placements"], o["grad"]) for o in row["outputs"]] == [("P", "R")]
        assert row["inputs"][1]["local"] == {"dtype": "f32", "shape": [8, 16]}
        # P -> R of _row's output (user redistribute) is the only collective;
        # x's grad stays Partial (in_grad_placements) so backward has none.
        (ar,) = s["collectives"]["forward"]
        assert (ar["op"], ar["reduce_op"], ar["mesh_dim"], ar["group_size"]) == ("all_reduce", "sum", "tp", 4)
        assert ar["bytes_per_rank"] == 8 * 16 * 4
        assert (ar["boundary"], ar["input_from"]) == ("user code", ["r1"])
        assert s["collectives"]["backward"] == []
        assert s["errors"] == []

    def test_summary_md_pinned(self):
        with open(os.path.join(self.redistribute, "summary.md")) as f:
            text = model_sites(_norm(f.read()))
        # Hand-checked: x arrives S(1) and is needed S(0) (DTensor plans
        # all_to_all; the CPU group runs it as all_gather + chunk), w goes
        # S(0) -> R (all_gather); the user's y.redistribute(R) gathers once
        # more.  Backward: x's grad goes back S(0) -> S(1) (one gather); w's
        # R -> S(0) grad and y's are local chunks.  Local shards: 8x8 f32 over
        # 4 ranks -> 2x8 or 8x2 = 64 bytes.  The border: x and w in, the loss
        # out, which feeds no input, so its default gradient (R) is compiled.
        self.assertExpectedInline(text, """\
# localmap_fx dump rank0-frameN-M

inner compiler: aot_eager · regions: 1 · collectives: forward 3, backward 1

## Regions

| id | region | call site | mesh | in | out | in grad | out grad | local inputs | local outputs |
|---|---|---|---|---|---|---|---|---|---|
| r0 | _scale_rows | models.py:_redistribute_step+2 (_redistribute_step) | tp:4 | S(1)->S(0), S(0)->R | S(0) | S(0), R | S(0) | f32[2, 8], f32[8, 8] | f32[2, 8] |

## Redistributions at region entry (planned)

| region | arg | step | collective | mesh dim | group size | bytes/rank |
|---|---|---|---|---|---|---|
| r0 _scale_rows | arg0 | S(1)->S(0)@tp:all_to_all | all_to_all | tp | 4 | 64 |
| r0 _scale_rows | arg1 | S(0)->R@tp:all_gather | all_gather | tp | 4 | 64 |

## DTensor border

DTensor border: 2 DTensor inputs, 1 DTensor outputs; backward for tangents (R) (planned: compile (R))

## Collectives

| # | phase | op | mesh dim | group size | bytes/rank | caused by | source line |
|---|---|---|---|---|---|---|---|
| 0 | forward | all_gather_into_tensor | tp | 4 | 64 | r0 _scale_rows enter arg0 | models.py:_redistribute_step+2 |
| 1 | forward | all_gather_into_tensor | tp | 4 | 64 | r0 _scale_rows enter arg1 | models.py:_redistribute_step+2 |
| 2 | forward | all_gather_into_tensor | tp | 4 | 64 | user code (input from r0) | models.py:_redistribute_step+3 |
| 3 | backward | all_gather_into_tensor | tp | 4 | 64 | r0 _scale_rows enter arg0 | models.py:_redistribute_step+2 |

## Files

- `captured_graph.txt`: the graph Dynamo captured (DTensor level, regions annotated)
- `region_0.txt`: region r0 (_scale_rows): spec, call site, body at local shapes
- `summary.json`: machine-readable tables (this file's data)
- `summary.md`: this file
- `pass_inline_shared_bodies.txt`: the graph after the inline_shared_bodies pass
- `pass_lower_boundaries.txt`: the graph after the lower_boundaries pass
- `pass_fuse_boundaries.txt`: the graph after the fuse_boundaries pass
- `lowered_graph.txt`: the graph handed to the inner compiler
- `aot_forward.txt`: AOTAutograd forward graph (local tensors, functional collectives)
- `aot_backward.txt`: AOTAutograd backward graph
""")

    # --- CLI ------------------------------------------------------------------

    def test_cli_prints_tables(self):
        rc, out, _ = _run_cli("inspect", self.redistribute)
        assert rc == 0
        with open(os.path.join(self.redistribute, "summary.md")) as f:
            assert out == f.read()

    def test_cli_on_dump_root_lists_every_frame(self):
        rc, out, _ = _run_cli("inspect", os.path.dirname(self.tp_mlp))
        assert rc == 0 and "| r1 | _row |" in out

    def test_cli_diff(self):
        rc, out, _ = _run_cli("inspect", self.tp_mlp, "--diff", self.tp_mlp)
        assert (rc, out.strip()) == (0, "no difference in regions or collectives")
        rc, out, _ = _run_cli("inspect", self.tp_mlp, "--diff", self.redistribute)
        assert rc == 1
        lines = model_sites(out).splitlines()
        assert "  - region r0 _col (models.py:_tp_mlp_step+2)" in lines
        assert "  + region r0 _scale_rows (models.py:_redistribute_step+2)" in lines
        assert "  ~ forward collectives: 1 -> 3" in lines
        assert "  ~ backward collectives: 0 -> 1" in lines
        assert "  - 1x forward all_reduce (sum) tp x4 512 B/rank, user code (input from r1)" in lines

    def test_cli_bad_dir(self):
        rc, _, err = _run_cli("inspect", os.path.join(self.tp_mlp, "nope"))
        assert rc == 2 and "not a folder" in err

    def test_python_dash_m(self):
        out = subprocess.run(
            [sys.executable, "-m", "localmap_fx", "inspect", self.tp_mlp, "-q", "--dot", os.path.join(self.tp_mlp, "..", "g.dot")],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        with open(os.path.join(os.path.dirname(self.tp_mlp), "g.dot")) as f:
            dot = f.read()
        assert dot.startswith("digraph localmap_fx {")
        assert '"r0" -> "r1" [label="arg0: S(1)"];' in dot


# --- drawing ------------------------------------------------------------------------


def test_svg_without_graphviz(redistribute_dump, monkeypatch):
    # our own layout: works with Graphviz absent
    monkeypatch.setattr(draw, "find_dot", lambda: None)
    out = os.path.join(os.path.dirname(redistribute_dump), "regions.svg")
    rc, _, err = _run_cli("inspect", redistribute_dump, "-q", "--svg", out)
    assert rc == 0, err
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "_scale_rows" in texts and "all_gather_into_tensor" in texts and "S(1)->S(0)" in texts
    groups = [g for g in root.iter() if g.tag.endswith("g")]
    nodes = {g.get("id") for g in groups if "node" in (g.get("class") or "")}
    # 2 inputs, 1 region, the output, 4 collectives (3 forward, 1 backward)
    assert nodes == {"in0", "in1", "r0", "out", "c0", "c1", "c2", "c3"}
    edges = {(g.get("data-src"), g.get("data-dst")) for g in groups if g.get("class") == "edge"}
    assert {("in0", "r0"), ("in1", "r0"), ("r0", "out"), ("c0", "r0"), ("r0", "c2")} <= edges
    # Writing again replaces our own file; a foreign file is left alone.
    assert _run_cli("inspect", redistribute_dump, "-q", "--svg", out)[0] == 0
    foreign = os.path.join(os.path.dirname(redistribute_dump), "notes.svg")
    with open(foreign, "w") as f:
        f.write("<svg>mine</svg>")
    rc, _, err = _run_cli("inspect", redistribute_dump, "-q", "--svg", foreign)
    assert rc == 2 and "--force" in err
    with open(foreign) as f:
        assert f.read() == "<svg>mine</svg>"

def test_png(tp_mlp_dump):
    pil = pytest.importorskip("PIL.Image", reason="Pillow draws PNGs (requirements-dev.txt installs it)")
    out = os.path.join(os.path.dirname(tp_mlp_dump), "regions.png")
    rc, _, err = _run_cli("inspect", tp_mlp_dump, "-q", "--png", out)
    assert rc == 0, err
    with pil.open(out) as img:
        assert img.format == "PNG" and img.width > 400 and img.height > 100
        assert img.text.get("Software") == "localmap_fx region graph"
        # not blank: the boxes are filled
        assert len(set(img.convert("RGB").getdata())) > 10
    assert _run_cli("inspect", tp_mlp_dump, "-q", "--png", out)[0] == 0  # ours: replaced

def test_svg_with_graphviz(redistribute_dump):
    if draw.find_dot() is None:
        pytest.skip("Graphviz `dot` is not installed (only --layout graphviz needs it)")
    out = os.path.join(os.path.dirname(redistribute_dump), "regions_dot.svg")
    rc, _, err = _run_cli("inspect", redistribute_dump, "-q", "--layout", "graphviz", "--svg", out)
    assert rc == 0, err
    texts = " ".join(t.text or "" for t in ET.parse(out).getroot().iter() if t.tag.endswith("text"))
    assert "_scale_rows" in texts and "all_gather_into_tensor" in texts
    png = os.path.join(os.path.dirname(redistribute_dump), "regions_dot.png")
    for _ in range(2):  # the second run replaces the file it wrote (marker chunk)
        rc, _, err = _run_cli("inspect", redistribute_dump, "-q", "--layout", "graphviz", "--png", png)
        assert rc == 0, err
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

def test_missing_dot_says_how_to_install(redistribute_dump, monkeypatch):
    monkeypatch.setattr(draw, "find_dot", lambda: None)
    x = os.path.join(redistribute_dump, "..", "x.svg")
    rc, _, err = _run_cli("inspect", redistribute_dump, "-q", "--layout", "graphviz", "--svg", x)
    assert rc == 3
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    assert "Drop --layout graphviz" in err

def test_drawing_a_torchrun_dump_picks_rank0(tp_mlp_dump, tmp_path):
    # a torchrun dump: one frame per rank (and rank 0 compiled two frames)
    with open(os.path.join(tp_mlp_dump, "summary.json")) as f:
        s = json.load(f)
    for name in ("rank1-frame0-0", "rank0-frame1-0", "rank0-frame0-0", "rank10-frame0-0"):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "summary.json", "w") as f:
            json.dump({**s, "frame": name}, f)
    out = str(tmp_path / "g.svg")
    rc, _, err = _run_cli("inspect", str(tmp_path), "-q", "--svg", out)
    assert rc == 0, err
    assert "drawing rank0-frame0-0 (rank 0's first)" in err and "--frame" in err
    assert "rank0-frame0-0" in " ".join(t.text or "" for t in ET.parse(out).getroot().iter())
    rc, _, err = _run_cli("inspect", str(tmp_path), "-q", "--frame", "rank1-frame0-0", "--svg", out, "--force")
    assert rc == 0 and "rank1-frame0-0" in err


def test_dot_text_escapes_labels():
    summary = {
        "frame": "f",
        "inner": "eager",
        "regions": [{"id": "r0", "func": 'we"ird\\name', "call_site": "/a/b.py:1", "inputs": [], "outputs": []}],
        "graph": {"nodes": [{"id": "r0", "kind": "region", "label": "x"}], "edges": []},
        "collectives": {},
    }
    dot = draw.to_dot(summary)
    assert 'we\\"ird\\\\name' in dot
    if draw.find_dot() is not None:
        ET.fromstring(draw.render_graphviz(dot))
    # our SVG escapes the same label for XML
    svg = layout.to_svg(layout.layout(draw.scene(summary)))
    assert 'we"ird\\name' in " ".join(t.text or "" for t in ET.fromstring(svg).iter())


# --- attribution, frames, options ------------------------------------------------


def test_loop_collective_attributed_to_the_last_call(tmp_path):
    _compile("loop3", dump_dir=str(tmp_path))
    with open(os.path.join(_only_frame(tmp_path), "summary.json")) as f:
        s = json.load(f)
    assert [r["id"] for r in s["regions"]] == ["r0", "r1", "r2"]
    assert len({r["call_site"] for r in s["regions"]}) == 1  # one source line, three calls
    (ag,) = s["collectives"]["forward"]
    assert (ag["op"], ag["input_from"]) == ("all_gather_into_tensor", ["r2"])


def test_mesh2d_collectives_name_their_mesh_dim(tmp_path):
    _compile("mesh2d", dump_dir=str(tmp_path))
    with open(os.path.join(_only_frame(tmp_path), "summary.json")) as f:
        s = json.load(f)
    got = [(c["op"], c["mesh_dim"], c["group_size"]) for c in s["collectives"]["forward"]]
    # (S(0), P) -> (R, R): all_reduce over tp, then all_gather over dp.
    assert got == [("all_reduce", "tp", 2), ("all_gather_into_tensor", "dp", 2)]


def _two_regions_with_graph_break(state):
    col, row = state["fns"]
    h = col(state["x"], state["w1"])
    torch._dynamo.graph_break()
    return row(h, state["w2"]).redistribute(state["mesh"], [torch.distributed.tensor.Replicate()]).sum()


def test_one_folder_per_compiled_frame_and_user_hooks_kept(tmp_path):
    state = MODELS["tp_mlp"].build(mesh_for(1), 0)
    rec = Recorder("aot_eager", dump_dir=str(tmp_path))
    torch.compile(_two_regions_with_graph_break, backend=rec.backend)(state).backward()
    frames = _frames(tmp_path)
    assert len(frames) == 2, frames
    funcs = []
    for fr in frames:
        with open(os.path.join(tmp_path, fr, "summary.json")) as f:
            funcs.append([r["func"] for r in json.load(f)["regions"]])
    assert sorted(funcs) == [["_col"], ["_row"]]
    # the user's hooks (the Recorder's) still saw every stage and AOT graph
    assert len(rec.stages["captured"]) == 2 and len(rec.aot["forward"]) == 2


def _dumped(root, name):
    (frame,) = _frames(root)
    with open(os.path.join(root, frame, name)) as f:
        return f.read()


def test_lowered_graph_is_what_the_inner_compiler_received(tmp_path, monkeypatch):
    """lowered_graph.txt is the graph handed to the inner compiler whole, or,
    for a frame split into layers, the graph cut into pieces: after every
    rewrite, plain borders included (it once showed the graph before them)."""
    from localmap_fx.compiler import inner
    from localmap_fx.debug.tables import graph_text
    from localmap_fx.testing.models import TPStack, tp_stack_input

    received = []

    def recording_eager(gm, example_inputs, *rest):
        received.append(graph_text(gm))
        return gm.forward

    monkeypatch.setitem(inner.INNER, "eager", recording_eager)
    mesh = mesh_for(1)
    model, x = TPStack(mesh, 4, d=16, hidden=32), tp_stack_input(mesh, 8, 16)
    torch._dynamo.reset()
    torch.compile(model, backend=localmap_fx.backend("eager", share_layers=False, dump_dir=str(tmp_path / "whole")))(x)
    assert received and _dumped(tmp_path / "whole", "lowered_graph.txt") == received[0]

    received.clear()
    torch._dynamo.reset()
    torch.compile(model, backend=localmap_fx.backend("eager", share_layers=True, dump_dir=str(tmp_path / "split")))(x)
    lowered = _dumped(tmp_path / "split", "lowered_graph.txt")
    assert lowered == _dumped(tmp_path / "split", "pass_plain_borders.txt")
    assert lowered != _dumped(tmp_path / "split", "pass_fuse_boundaries.txt")
    # the pieces the inner compiler received: one per layer key, plus the tail
    # (the prefix only unwraps: Note: [A piece that only unwraps runs as an Unwrap])
    assert len(received) == 2 and all("class piece_" in r for r in received), [r.splitlines()[0] for r in received]


def test_env_var_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "from_env"))
    assert localmap_fx.BackendOptions().dump_dir is None
    _compile("partial_grad", inner="eager", backward=False)
    d = _only_frame(tmp_path / "from_env")
    assert set(os.listdir(d)) == BASE_FILES | {"region_0.txt"}
    with open(os.path.join(d, "summary.md")) as f:
        assert "collectives: unknown (inner compiler eager has no AOT graphs)" in f.read()


def test_nothing_dumped_or_wrapped_when_off(monkeypatch):
    from localmap_fx.debug import dump

    monkeypatch.delenv(ENV_VAR, raising=False)
    made = []

    def spy(opts):
        made.append(inspector_for(opts))
        return made[-1]

    monkeypatch.setattr(dump, "inspector_for", spy)
    _compile("partial_grad", inner="eager", backward=False)
    assert made == [None]


@pytest.mark.inductor
def test_inductor_pointer(tmp_path):
    _compile("partial_grad", inner="inductor", dump_dir=str(tmp_path))
    d = _only_frame(tmp_path)
    with open(os.path.join(d, "inductor_forward.txt")) as f:
        text = f.read()
    path = re.search(r"generated code: (\S+)", text).group(1)
    assert os.path.isfile(path)
    assert {"aot_forward.txt", "aot_backward.txt", "inductor_backward.txt"} <= set(os.listdir(d))


# --- safe writing ----------------------------------------------------------------


def test_unwritable_dump_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(DumpDirError, match=r"cannot write its dump to .*a_file.*LOCALMAP_FX_DUMP_DIR"):
        _compile("partial_grad", inner="eager", backward=False, dump_dir=str(blocker / "dumps"))
    assert blocker.read_text() == "not a folder"


def test_folders_are_never_reused_and_foreign_files_never_replaced(tmp_path):
    (tmp_path / "unrelated.txt").write_text("keep")
    a = FrameFolder(str(tmp_path), "rank0-frame0-0")
    b = FrameFolder(str(tmp_path), "rank0-frame0-0")
    assert (a.name, b.name) == ("rank0-frame0-0", "rank0-frame0-0.1")
    a.write("summary.md", "one")
    a.write("summary.md", "two")  # its own file: replaced atomically
    assert (tmp_path / "rank0-frame0-0" / "summary.md").read_text() == "two"
    (tmp_path / "rank0-frame0-0.1" / "summary.md").write_text("someone else's")
    with pytest.raises(DumpDirError, match="did not create it"):
        b.write("summary.md", "x")
    assert (tmp_path / "rank0-frame0-0.1" / "summary.md").read_text() == "someone else's"
    for bad in ("../escape.txt", "sub/x.txt", ".hidden", ""):
        with pytest.raises(ValueError, match="unsafe"):
            a.write(bad, "x")
    assert (tmp_path / "unrelated.txt").read_text() == "keep"
    assert not [p for p in os.listdir(tmp_path / "rank0-frame0-0") if p.endswith(".tmp")]


# --- torch logging: TORCH_TRACE artifacts, TORCH_LOGS=localmap_fx_regions ----------


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_trace_structured_artifacts(monkeypatch):
    from torch._logging._internal import trace_log

    monkeypatch.delenv(ENV_VAR, raising=False)
    handler = _Collect()
    trace_log.addHandler(handler)
    try:
        _compile("tp_mlp")
    finally:
        trace_log.removeHandler(handler)
    names = [
        r.metadata["artifact"]["name"]
        for r in handler.records
        if "artifact" in getattr(r, "metadata", {}) and r.metadata["artifact"]["name"].startswith("localmap_fx_")
    ]
    for expected in ("localmap_fx_captured_graph", "localmap_fx_region_0", "localmap_fx_region_1",
                     "localmap_fx_lowered_graph", "localmap_fx_aot_forward", "localmap_fx_aot_backward",
                     "localmap_fx_summary", "localmap_fx_summary_md"):
        assert expected in names, (expected, names)
    summaries = [r.payload for r in handler.records if getattr(r, "metadata", {}).get("artifact", {}).get("name") == "localmap_fx_summary"]
    assert json.loads(summaries[-1])["collectives"]["forward"][0]["op"] == "all_reduce"


@pytest.mark.slow
def test_torch_logs_regions_artifact():
    if not any(ep.name == "localmap_fx_logs" for ep in entry_points(group="torch.backends")):
        pytest.skip("localmap_fx is not pip-installed (`pip install -e .` registers TORCH_LOGS names)")
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch, localmap_fx\n"
        "from helpers import mesh_for\n"
        "from localmap_fx.testing.models import MODELS\n"
        "m = MODELS['partial_grad']; s = m.build(mesh_for(1), 0)\n"
        "torch.compile(m.step, backend=localmap_fx.backend('eager'), fullgraph=True)(s)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "TORCH_TRACE")}
    env["TORCH_LOGS"] = "localmap_fx_regions"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[__localmap_fx_regions]" in out.stderr
    assert "# localmap_fx region r0: _col" in out.stderr
    assert "| r0 | _col |" in out.stderr


# --- data-dependent sizes (issue #11) -----------------------------------------------


@localmap_fx.local_map(out_placements=[Shard(0)], in_placements=([Shard(0)],))
def _scale(x):
    return x * 2


def test_data_dependent_split_sizes_keep_the_collective_table(tmp_path):
    # all_to_all split sizes from .tolist() (capture_scalar_outputs): the second
    # exchange's input has a size known only at run time (u0 + u1 + ...).  Its
    # bytes must be written as an expression, the table kept.
    import torch.distributed._functional_collectives as funcol

    mesh = mesh_for(1)
    group = mesh.get_group(0)

    def step(x, splits):
        local = _scale(x).to_local()
        sizes = splits.tolist()
        out = funcol.all_to_all_single(local, sizes, sizes, group)
        return funcol.all_to_all_single(out * 3, sizes, sizes, group)

    x = distribute_tensor(torch.randn(16, 8, requires_grad=True), mesh, [Shard(0)])
    splits = torch.ones(4, dtype=torch.int64)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(step, backend=localmap_fx.backend("aot_eager", dump_dir=str(tmp_path)), fullgraph=True)(
            x, splits
        )
        out.sum().backward()
    torch._dynamo.reset()
    frame = _only_frame(tmp_path)
    with open(os.path.join(frame, "summary.json")) as f:
        s = json.load(f)
    assert s["errors"] == []
    fwd, bwd = s["collectives"]["forward"], s["collectives"]["backward"]
    assert [c["op"] for c in fwd] == ["all_to_all_single", "all_to_all_single"]
    assert fwd[0]["bytes_per_rank"] == 4 * 8 * 4  # local 4x8 f32: static
    symbolic = fwd[1]
    assert isinstance(symbolic["bytes_per_rank"], str) and "u0" in symbolic["bytes_per_rank"]
    assert symbolic["input"]["shape"][1] == 8 and "u0" in symbolic["input"]["shape"][0]
    assert len(bwd) == 2 and all(isinstance(c["bytes_per_rank"], str) for c in bwd)
    assert [r["func"] for r in s["regions"]] == ["_scale"]
    with open(os.path.join(frame, "summary.md")) as f:
        md = f.read()
    assert f"| {symbolic['bytes_per_rank']} |" in md.replace("\\|", "|")


def test_dump_names_the_border_and_its_plan(tmp_path):
    """A regional TP block's dump says it runs behind the lean DTensor border
    and which gradient it was compiled for (Note: [The gradient a stack sends
    back]); with ``lean_border=False`` it says it runs on AOTAutograd's runtime."""
    from torch.distributed.tensor import Partial

    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_for(1)
    for lean, expected in ((True, "(planned: compile (P(sum)))"), (False, None)):
        torch._dynamo.reset()
        root = tmp_path / str(lean)
        block, x = TPStack(mesh, 1, d=16, hidden=32).blocks[0], tp_stack_input(mesh, 8, 16)
        f = torch.compile(block, backend=localmap_fx.backend("aot_eager", lean_border=lean, dump_dir=str(root)))
        (f(x).to_local(grad_placements=[Partial()]) ** 2).sum().backward()
        with open(os.path.join(root, _only_frame(root), "summary.md")) as fh:
            text = fh.read()
        if expected is None:
            assert "## DTensor border" not in text
        else:
            assert "## DTensor border" in text and expected in text, text


def test_dump_says_why_the_border_is_not_used(tmp_path):
    """Compiled under no_grad, a graph keeps AOTAutograd's inference runtime; the dump says so and why."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_for(1)
    torch._dynamo.reset()
    block, x = TPStack(mesh, 1, d=16, hidden=32).blocks[0], tp_stack_input(mesh, 8, 16)
    with torch.no_grad():
        torch.compile(block, backend=localmap_fx.backend("aot_eager", dump_dir=str(tmp_path)))(x)
    with open(os.path.join(tmp_path, _only_frame(tmp_path), "summary.md")) as fh:
        text = fh.read()
    assert "not used, AOTAutograd's runtime instead: compiled under no_grad" in text, text
