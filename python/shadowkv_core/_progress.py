"""A dependency-free progress bar for the demo and the benchmarks (writes to stderr, one line, redrawn)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, label: str, width: int = 30, stream=None) -> None:
        self.total = max(1, total)
        self.label = label
        self.width = width
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.perf_counter()

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {rate:6.1f}/s {note}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()
