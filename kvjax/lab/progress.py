"""A dependency-free progress bar for long work: count, rate, ETA and live metrics."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress(total, "train") as bar: bar.update(1, loss=2.3)`.

    On a terminal it redraws one line; otherwise it prints a line every `every_s` seconds.
    """

    def __init__(self, total: int, desc: str = "", start: int = 0, every_s: float = 0.5,
                 stream=None):
        self.total, self.desc, self.n = total, desc, start
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every_s = every_s if self.tty else max(every_s, 10.0)
        self.t0 = self.last = time.perf_counter()
        self.start = start
        self.metrics: dict[str, str] = {}
        self._drawn = -1

    def update(self, n: int = 1, **metrics) -> None:
        self.n += n
        for key, value in metrics.items():
            self.metrics[key] = f"{value:.4g}" if isinstance(value, float) else str(value)
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = self.n
        done = self.n - self.start
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - self.n) / rate if rate > 0 else float("inf")
        frac = self.n / max(self.total, 1)
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        extra = " ".join(f"{k} {v}" for k, v in self.metrics.items())
        eta_text = f"{int(eta // 60)}:{int(eta % 60):02d}" if eta != float("inf") else "?"
        line = (f"{self.desc} [{bar}] {self.n}/{self.total} {extra} ETA {eta_text}")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._drawn != self.n:
            self._draw(time.perf_counter())
        if self.tty:
            self.stream.write("\n")
