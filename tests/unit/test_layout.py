"""Our own region-graph drawing (localmap_fx.debug.layout): geometry, SVG, PNG."""

from __future__ import annotations

import itertools
import sys
import xml.etree.ElementTree as ET

import pytest

from localmap_fx.debug import layout
from localmap_fx.debug.draw import Link, Scene, Shape


def _scene(links=None) -> Scene:
    shapes = (
        Shape("in0", "input", "x\nR f32[8, 16]"),
        Shape("in1", "input", "w\nS(0) f32[16, 16]"),
        Shape("r0", "region", "r0  _col\nmodels.py:3\nin [R, S(0)]  out [S(1)]\nmesh tp:4", "#eef5e9"),
        Shape("r1", "region", "r1  _row\nmodels.py:4\nin [S(1)]  out [P]\nmesh tp:4", "#eef5e9"),
        Shape("out", "output", "output"),
        Shape("c0", "collective", "forward #0\nall_gather_into_tensor\ntp x4 · 64 B/rank", "#fde0dc", "r1 _row enter arg0"),
        Shape("c1", "collective", "forward #1\nall_reduce (sum)\ntp x4 · 512 B/rank", "#fde0dc", "user code"),
    )
    if links is None:
        links = (
            Link("in0", "r0", "arg0: R", "solid"),
            Link("in1", "r0", "arg1: S(0)", "solid"),
            Link("r0", "r1", "arg0: S(1)", "dashed", "through user code"),
            Link("r1", "out", "out0: P", "solid"),
            Link("c0", "r1", "arg0", "dotted"),
            Link("r1", "c1", "user code", "dotted"),
        )
    return Scene("localmap_fx test (inner=eager)", shapes, tuple(links))


def _overlap(a: layout.Box, b: layout.Box) -> bool:
    return a.x < b.x + b.w and b.x < a.x + a.w and a.y < b.y + b.h and b.y < a.y + a.h


def test_layered_left_to_right_without_overlap():
    pic = layout.layout(_scene())
    box = {b.id: b for b in pic.boxes}
    assert set(box) == {"in0", "in1", "r0", "r1", "out", "c0", "c1"}
    for a, b in itertools.combinations(pic.boxes, 2):
        assert not _overlap(a, b), (a.id, b.id)
    # every edge goes right: data flows from inputs to the output
    for c in pic.curves:
        assert box[c.src].x + box[c.src].w < box[c.dst].x, (c.src, c.dst)
    # a collective feeding a region's entry sits in the column just before
    # it, not in the first column
    assert box["in0"].x + box["in0"].w < box["c0"].x and box["c0"].x + box["c0"].w < box["r1"].x
    # everything inside the picture, below the title
    for b in pic.boxes:
        assert 0 <= b.x and b.x + b.w <= pic.width and layout.TITLE_H <= b.y and b.y + b.h <= pic.height
    # boxes are large enough for their text (monospace estimate)
    r0 = box["r0"]
    assert r0.w >= max(len(s) for s in r0.lines) * layout.CHAR_W and r0.h >= 4 * layout.LINE_H
    assert layout.layout(_scene()) == pic  # deterministic


def test_edges_into_one_box_do_not_meet_in_one_point():
    pic = layout.layout(_scene())
    ends = [c.points[-1] for c in pic.curves if c.dst == "r0"]
    assert len(ends) == 2 and ends[0] != ends[1]


def test_a_cycle_does_not_break_the_layout():
    links = (Link("r0", "r1", None, "solid"), Link("r1", "r0", None, "solid"), Link("in0", "r0", None, "solid"))
    pic = layout.layout(_scene(links))
    assert len(pic.curves) == 3 and len(pic.boxes) == 7


def test_svg_is_xml_with_every_shape_and_edge():
    sc = _scene()
    svg = layout.to_svg(layout.layout(sc))
    assert layout.MARKER in svg[:4096]  # the CLI replaces only files holding it
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    groups = list(root.iter(f"{ns}g"))
    nodes = [g for g in groups if g.get("class", "").startswith("node")]
    edges = [g for g in groups if g.get("class") == "edge"]
    assert sorted(g.get("id") for g in nodes) == sorted(s.id for s in sc.shapes)
    assert len(edges) == len(sc.links)
    kinds = {g.get("id"): g.get("class") for g in nodes}
    assert kinds["r0"] == "node region" and kinds["c0"] == "node collective"
    assert nodes[[g.get("id") for g in nodes].index("c0")].find(f"{ns}polygon") is not None
    dashed = [g for g in edges if g.get("data-src") == "r0" and g.get("data-dst") == "r1"][0]
    assert dashed.find(f"{ns}path").get("stroke-dasharray") == "6,4"
    assert dashed.find(f"{ns}title").text == "through user code"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "r0  _col" in texts and "arg0: S(1)" in texts and "tp x4 · 64 B/rank" in texts


def test_svg_escapes_text():
    sc = Scene("a<b>&c", (Shape("r0", "region", "<script>&amp;"),), ())
    root = ET.fromstring(layout.to_svg(layout.layout(sc)))
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "a<b>&c" in texts and "<script>&amp;" in texts


def test_png_with_pillow():
    image = pytest.importorskip("PIL.Image", reason="Pillow draws PNGs (requirements-dev.txt installs it)")
    import io

    data = layout.to_png(layout.layout(_scene()))
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and layout.MARKER.encode() in data[:4096]
    with image.open(io.BytesIO(data)) as img:
        pic = layout.layout(_scene())
        assert abs(img.width - pic.width * 2) <= 1 and abs(img.height - pic.height * 2) <= 1  # scale 2
        # the region fill colour is painted
        # (getcolors, not getdata: deprecated in Pillow 12.1, removed in 14)
        rgb = img.convert("RGB")
        assert (0xEE, 0xF5, 0xE9) in {c for _, c in rgb.getcolors(maxcolors=rgb.width * rgb.height)}


def test_png_without_pillow_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # `import PIL...` raises ImportError
    with pytest.raises(layout.PillowNotFound, match="pip install pillow"):
        layout.to_png(layout.layout(_scene()))
