"""Horizontal bar charts as PNG files, with no dependency beyond zlib: an RGB canvas, a 5×7 bitmap
font (upper case, digits, a little punctuation; lower case is drawn upper case) and a PNG encoder."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

WHITE, BLACK, GRID, BAR = (255, 255, 255), (0, 0, 0), (215, 215, 215), (52, 101, 164)

# Seven rows of five bits per glyph (bit 4 = leftmost column), as hex.
_FONT = {
    "A": "0e11111f111111", "B": "1e11111e11111e", "C": "0e11101010110e", "D": "1e11111111111e",
    "E": "1f10101e10101f", "F": "1f10101e101010", "G": "0e11101711110f", "H": "1111111f111111",
    "I": "0e04040404040e", "J": "0702020202120c", "K": "11121418141211", "L": "1010101010101f",
    "M": "111b1515111111", "N": "11111915131111", "O": "0e11111111110e", "P": "1e11111e101010",
    "Q": "0e11111115120d", "R": "1e11111e141211", "S": "0f10100e01011e", "T": "1f040404040404",
    "U": "1111111111110e", "V": "11111111110a04", "W": "1111111515150a", "X": "11110a040a1111",
    "Y": "11110a04040404", "Z": "1f01020408101f", "0": "0e11131519110e", "1": "040c040404040e",
    "2": "0e11010204081f", "3": "1f02040201110e", "4": "02060a121f0202", "5": "1f101e0101110e",
    "6": "0608101e11110e", "7": "1f010204080808", "8": "0e11110e11110e", "9": "0e11110f01020c",
    " ": "00000000000000",
    ".": "00000000000c0c", ",": "000000000c0408", "-": "0000001f000000", "_": "0000000000001f",
    "=": "00001f001f0000", "+": "0004041f040400", "(": "02040808080402", ")": "08040202020408",
    "[": "0e08080808080e", "]": "0e02020202020e", "/": "00010204081000", ":": "000c0c000c0c00",
    "%": "18190204081303", "<": "02040810080402", ">": "08040201020408", "*": "0004150e150400",
    "?": "0e110102040004", "#": "0a0a1f0a1f0a0a", "|": "04040404040404",
}
_GLYPHS = {ch: bytes.fromhex(code) for ch, code in _FONT.items()}
GLYPH_W, GLYPH_H = 6, 7  # 5 columns plus one of spacing


class Canvas:
    def __init__(self, width: int, height: int, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, color) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        run = bytes(color) * (x1 - x0)
        for row in range(y0, y1):
            start = 3 * (row * self.width + x0)
            self.pixels[start:start + len(run)] = run

    def text(self, x: int, y: int, text: str, color=BLACK, scale: int = 1) -> None:
        for i, ch in enumerate(text):
            glyph = _GLYPHS.get(ch.upper(), _GLYPHS["?"])
            gx = x + i * GLYPH_W * scale
            for row, bits in enumerate(glyph):
                for col in range(5):
                    if bits & (0x10 >> col):
                        self.rect(gx + col * scale, y + row * scale, scale, scale, color)

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[r * stride:(r + 1) * stride]) for r in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(text: str, scale: int = 1) -> int:
    return len(text) * GLYPH_W * scale


def bar_chart(path: Path, title: str, labels: list[str], values: list[float], *, unit: str = "%",
              scale: int = 2, bar_width: int = 400, label_chars: int = 48) -> tuple[int, int]:
    """Write a horizontal bar chart; the axis runs from 0 to at least 100 in steps of 25. Returns (w, h)."""
    labels = [lb if len(lb) <= label_chars else lb[:label_chars - 2] + ".." for lb in labels]
    top = max([100.0] + [v for v in values if not math.isnan(v)])
    top = 25.0 * -(-top // 25)
    line = GLYPH_H * scale + 8
    pad = 10
    label_w = max([text_width(lb, scale) for lb in labels] + [0])
    value_w = text_width(f"{top:.1f}{unit}", scale) + pad
    x0 = pad + label_w + pad
    y0 = pad + line + pad  # below the title
    width = x0 + bar_width + pad + value_w
    height = y0 + line * len(labels) + pad + line
    canvas = Canvas(width, height)
    canvas.text(pad, pad, title, scale=scale)
    for tick in range(0, int(top) + 1, 25):
        x = x0 + round(bar_width * tick / top)
        canvas.rect(x, y0 - 4, 1, line * len(labels) + 8, GRID)
        label = f"{tick}"
        canvas.text(x - text_width(label, scale) // 2, y0 + line * len(labels) + 6, label, scale=scale)
    for i, (label, value) in enumerate(zip(labels, values)):
        y = y0 + i * line
        canvas.text(pad, y + 4, label, scale=scale)
        if not math.isnan(value):
            canvas.rect(x0, y + 2, round(bar_width * max(value, 0.0) / top), line - 4, BAR)
            canvas.text(x0 + bar_width + pad, y + 4, f"{value:.1f}{unit}", scale=scale)
    canvas.rect(x0 - 1, y0 - 4, 1, line * len(labels) + 8, BLACK)  # the axis, left of the bars
    path.write_bytes(canvas.png())
    return width, height
