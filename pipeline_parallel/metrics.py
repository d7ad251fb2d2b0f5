"""Training metrics: throughput figures, the JSONL log (plus TensorBoard), and the loss-curve PNG."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

from ._files import atomic_write

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of each rank's step in GPipe/1F1B with equal stages: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class MetricsLogger:
    """Appends one JSON object per line to run_dir/metrics.jsonl, and to TensorBoard when installed.

    On a resumed run the lines after the resumed step are dropped first (they were logged by the
    interrupted run after its last checkpoint), so the file always reads as one run. Lines that cannot
    be written (a full disk) wait in memory, with `error` set, and go out whole with the next line that
    can be (part of a line written is taken back); the trainer tries them once more before each
    checkpoint and stops if they still cannot, so that the resumed run logs those steps again. TensorBoard's
    writer cannot take its records again once it failed: it is closed, with `tensorboard_error` set, which
    stops the run at the next checkpoint as well.
    """

    def __init__(self, run_dir: str | Path, start_step: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step] if start_step else []
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # a full disk keeps the old records
        self.file = open(self.path, "ab", buffering=0)  # each write reaches the file, or fails, at once
        self.pending: list[bytes] = []
        self.error: OSError | None = None
        self.tensorboard_error: OSError | None = None
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional: pip install tensorboard
                pass
            else:
                self.tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=start_step + 1)

    def log(self, record: dict) -> None:
        self.pending.append((json.dumps(record) + "\n").encode())
        self.write_pending()
        if self.tb is not None:
            try:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.tb.add_scalar(key, value, record["step"])
            except OSError as e:  # a full disk: its writing thread died, and every later call would raise
                self.tensorboard_error = e
                self._close_tensorboard()

    def write_pending(self) -> None:
        """Write the lines waiting to be written; on failure keep them waiting, with `error` saying why."""
        data, end = b"".join(self.pending), self.file.tell()
        try:
            done = 0
            while done < len(data):  # a raw write may take only part
                done += self.file.write(data[done:])
        except OSError as e:
            self.error = e
            try:
                self.file.truncate(end)  # no half line before the next one
                self.file.seek(end)
            except OSError:  # a file that cannot be cut: its last line may stay half, which read_metrics allows
                pass
        else:
            self.pending, self.error = [], None

    def unwritten(self) -> tuple[Path, OSError] | None:
        """Where records this logger was given could not be written, and why; None if all were."""
        if self.pending:
            return self.path, self.error
        if self.tensorboard_error:
            return self.path.parent / TENSORBOARD_DIR, self.tensorboard_error
        return None

    def close(self) -> None:
        self.file.close()
        self._close_tensorboard()

    def _close_tensorboard(self) -> None:
        tb, self.tb = self.tb, None
        if tb is not None:
            try:
                tb.close()
            except OSError as e:  # its last records: the run has ended, or stops at its next checkpoint
                self.tensorboard_error = self.tensorboard_error or e


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file ([] if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}, record {i + 1}, is not JSON: {line[:80]!r}; repair or delete "
                                 "that line") from None
            # a last line cut off by a kill or a full disk: that record is lost, the run is not
    return records


def plot_loss(metrics_path: str | Path, png_path: str | Path) -> str:
    """Draw train and eval loss against step into a PNG; returns which renderer drew it.

    Uses matplotlib when installed (pip install 'pipeline_parallel[plot]'), else a small built-in
    renderer (axes, tick labels, two lines), so every run ends with a picture of its loss.
    """
    records = read_metrics(metrics_path)
    # A loss that is not finite (say, of a diverged evaluation) has no place on the axes.
    train = [(r["step"], r["loss"]) for r in records if math.isfinite(r.get("loss", math.nan))]
    evals = [(r["step"], r["eval_loss"]) for r in records if math.isfinite(r.get("eval_loss", math.nan))]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(png_path).write_bytes(_render_png(train, evals))
        return "built-in"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", color="#1f77b4", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval", color="#ff7f0e")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return "matplotlib"


# A 3x5 pixel font: each glyph is five rows of three bits.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111111100111", "a": "000011101101011", "i": "010000010010010", "l": "110010010010111",
    "n": "000110101101101", "o": "000111101101111", "p": "000111101111100", "r": "000111100100100",
    "s": "000011110001110", "t": "010111010010011", "v": "000101101101010", " ": "0" * 15,
}
_BLUE, _ORANGE, _GREY, _BLACK = (31, 119, 180), (255, 127, 14), (225, 225, 225), (40, 40, 40)


class _Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color, size: int = 1) -> None:
        for dx in range(size):
            for dy in range(size):
                if 0 <= x + dx < self.w and 0 <= y + dy < self.h:
                    i = 3 * ((y + dy) * self.w + x + dx)
                    self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color, size: int = 1) -> None:
        steps = max(1, int(max(abs(x1 - x0), abs(y1 - y0))))
        for i in range(steps + 1):
            t = i / steps
            self.dot(round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t), color, size)

    def text(self, x: int, y: int, s: str, color=_BLACK, scale: int = 2) -> None:
        for k, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT[" "])
            for bit, on in enumerate(glyph):
                if on == "1":
                    self.dot(x + (4 * k + bit % 3) * scale, y + (bit // 3) * scale, color, scale)

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        row = 3 * self.w
        raw = b"".join(b"\x00" + bytes(self.pixels[y * row : (y + 1) * row]) for y in range(self.h))
        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values spanning [lo, hi]."""
    span = (hi - lo) or 1.0
    raw = span / count
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 5, 10) if m * unit >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _label(v: float) -> str:
    return f"{v:.6g}" if abs(v) < 1e5 else f"{v:.1e}".replace("+", "")


def _render_png(train: list[tuple], evals: list[tuple], width: int = 800, height: int = 500) -> bytes:
    c = _Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    points = train + evals
    if points:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        y0, y1 = min(ys), max(ys)
        pad = (y1 - y0) * 0.05 or 0.5
        y0, y1 = y0 - pad, y1 + pad
        px = lambda x: left + (x - x0) / (x1 - x0) * (right - left)  # noqa: E731
        py = lambda y: bottom - (y - y0) / (y1 - y0) * (bottom - top)  # noqa: E731
        for t in _ticks(y0, y1):
            c.line(left, py(t), right, py(t), _GREY)
            label = _label(t)
            c.text(left - 8 - 8 * len(label), round(py(t)) - 5, label)
        for t in _ticks(x0, x1):
            c.line(px(t), top, px(t), bottom, _GREY)
            label = _label(t)
            c.text(round(px(t)) - 4 * len(label), bottom + 10, label)
        for series, color in ((train, _BLUE), (evals, _ORANGE)):
            for (a, b), (u, v) in zip(series, series[1:]):
                c.line(px(a), py(b), px(u), py(v), color, 2)
            for a, b in series if color == _ORANGE else []:
                c.dot(round(px(a)) - 2, round(py(b)) - 2, color, 5)
    c.line(left, top, left, bottom, _BLACK)
    c.line(left, bottom, right, bottom, _BLACK)
    c.text(width // 2 - 16, height - 22, "step")
    c.text(10, 12, "loss")
    c.line(right - 150, 20, right - 130, 20, _BLUE, 2)
    c.text(right - 122, 15, "train")
    c.line(right - 70, 20, right - 50, 20, _ORANGE, 2)
    c.text(right - 42, 15, "eval")
    return c.png()
