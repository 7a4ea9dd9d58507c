"""The combined benchmark report (``python -m dsv4jit bench``): row normalisation, CSV, markdown and
the dependency-free PNG bar charts (decoded here with zlib). No GPU needed."""

from __future__ import annotations

import csv
import struct
import zlib

import pytest

from dsv4jit.bench import png, report
from dsv4jit.bench.timing import BandwidthReport, Row

ROWS = [
    Row("compress", "prefill c4 hd512 1x8192", 25.7, "graph", 73_400_000, 2856.0, 66.9,
        {"eager": 30.1, "graph": 25.7, "over_empty": 24.8}),
    Row("compress", "decode c4 B=64, boundary | x", 2.57, "graph", 3_000_000, 1167.0, 27.6, {"eager": 7.9, "graph": 2.57}),
    Row("plan", "decode c4 B=256", 2.2, "graph", times={"wall": 20.0, "host": 11.0, "graph": 2.2}),
]


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB PNG; checks the signature, every CRC and the filters."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    assert all(raw[r * stride] == 0 for r in range(height)), "filter type 0 on every row"
    return width, height, [raw[r * stride + 1:(r + 1) * stride] for r in range(height)]


def test_png_bar_chart_is_a_valid_png_with_proportional_bars(tmp_path):
    path = tmp_path / "chart.png"
    width, height = png.bar_chart(path, "test: % of copy", ["half", "full", "quarter"], [50.0, 100.0, 25.0],
                                  bar_width=400)
    w, h, rows = decode_png(path.read_bytes())
    assert (w, h) == (width, height)
    bar = bytes(png.BAR)
    runs = []
    for row in rows:
        pixels = [row[i:i + 3] for i in range(0, len(row), 3)]
        if bar in pixels:
            runs.append(sum(p == bar for p in pixels))
    # three bars, each a solid run of bar pixels of length value% of 400
    assert sorted(set(runs)) == [100, 200, 400]
    text = sum(row.count(bytes(png.BLACK)) for row in rows)
    assert text > 0, "labels are drawn"


def test_png_canvas_rect_and_text_stay_inside():
    canvas = png.Canvas(10, 4)
    canvas.rect(-5, -5, 100, 6, png.BLACK)      # clipped to row 0
    canvas.text(8, 0, "W%", scale=3)
    w, h, rows = decode_png(canvas.png())
    assert (w, h) == (10, 4)
    assert rows[0] == bytes(png.BLACK) * 10 and rows[3][:3] == bytes(png.WHITE)


def test_csv_has_one_row_per_case_and_every_timing_column(tmp_path):
    path = tmp_path / "bench.csv"
    report.write_csv(ROWS, path)
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["bench", "case", "timing", "us", "bytes", "gbs", "pct_copy", "eager_us", "graph_us",
                            "over_empty_us", "wall_us", "host_us"]
    assert [r["case"] for r in got] == [r.case for r in ROWS]
    assert got[0]["pct_copy"] == "66.90" and got[0]["bytes"] == "73400000" and got[0]["over_empty_us"] == "24.800"
    assert got[2]["bytes"] == "" and got[2]["wall_us"] == "20.000" and got[2]["eager_us"] == ""


def test_markdown_sections_and_columns():
    text = report.markdown(ROWS, "# title\n")
    assert text.startswith("# title\n")
    compress = text[text.index("## compress"):text.index("## plan")]
    plan = text[text.index("## plan"):]
    assert "| case | MB | µs | timing | GB/s | % copy | eager µs | graph µs | over_empty µs |" in compress
    assert "| prefill c4 hd512 1x8192 | 73.400 | 25.70 | graph | 2856 | 66.9 | 30.10 | 25.70 | 24.80 |" in compress
    assert "boundary / x" in compress, "a '|' in a case name would break the table"
    assert "| case | µs | timing | wall µs | host µs | graph µs |" in plan
    assert "MB" not in plan and "% copy" not in plan


def test_write_report_writes_md_csv_and_one_png_per_bandwidth_bench(tmp_path):
    paths = report.write_report(ROWS, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["bench.csv", "bench.md", "compress.png"]
    w, h, _ = decode_png((tmp_path / "out" / "compress.png").read_bytes())
    assert w > 400 and h > 2 * png.GLYPH_H * 2


def test_rows_of_bandwidth_report_and_dict_reports():
    bw = BandwidthReport.__new__(BandwidthReport)   # skip the GPU measurements of __init__
    bw.rows = [{"case": "a", "bytes": 10, "eager_us": 3.0, "graph_us": 2.0, "over_empty_us": 1.0, "gbs": 5.0,
                "pct_copy": 0.1, "same_size_copy_us": 1.2, "pct_same_size_copy": 60.0},
               {"case": "b", "bytes": 10, "eager_us": 1.5, "graph_us": 2.0, "over_empty_us": 1.0, "gbs": 6.6,
                "pct_copy": 0.2}]
    a, b = report.rows_of("compress", bw)
    assert (a.us, a.timing, b.us, b.timing) == (2.0, "graph", 1.5, "eager")
    assert a.times == {"eager": 3.0, "graph": 2.0, "over_empty": 1.0, "same_size_copy": 1.2} and a.pct_copy == 0.1
    (row,) = report.rows_of("fused", {"rows": [{"case": "c", "bytes": 7, "two_step_graph_us": 4.0,
                                                "fused_eager_us": 3.0, "fused_graph_us": 2.5, "fused_gbs": 9.0,
                                                "fused_pct_copy": 1.5}]})
    assert (row.case, row.us, row.timing, row.gbs, row.pct_copy) == ("c", 2.5, "fused_graph", 9.0, 1.5)
    assert report.rows_of("plan", ROWS[2:]) == ROWS[2:]
    with pytest.raises(TypeError, match="timing.Row"):
        report.rows_of("x", [{"case": "d"}])


def test_discover_finds_the_benchmark_modules():
    names = report.discover()
    assert {"compress", "store", "plan", "overhead"} <= set(names)
    assert not set(names) & report.HELPERS and "loader" not in names   # loader has no run(): not a kernel bench
