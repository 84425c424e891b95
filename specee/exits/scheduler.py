"""Two-level layer scheduling: which layers' predictors run for the next token.

Offline, training ranks layers by how often tokens exit there and keeps the best (stored in the
artifact). Online, the exit layers of the last `window` exits add their neighbourhoods (+/-
`radius` layers): exits cluster in time, so a layer that served recently is worth checking.
"""
from __future__ import annotations

from collections import deque


class LayerScheduler:
    def __init__(self, offline: list[int], num_layers: int, window: int = 5, radius: int = 2) -> None:
        """`num_layers`: layers with a predictor (0 .. num_layers - 1)."""
        self.offline = frozenset(i for i in offline if 0 <= i < num_layers)
        self.num_layers = num_layers
        self.radius = radius
        self.recent: deque[int] = deque(maxlen=window)
        self._active = self._union()

    def _union(self) -> list[bool]:
        chosen = set(self.offline)
        for layer in self.recent:
            chosen.update(range(max(0, layer - self.radius), min(self.num_layers, layer + self.radius + 1)))
        return [i in chosen for i in range(self.num_layers)]

    def active(self) -> list[bool]:
        """[num_layers]: whether layer i's predictor runs for the next token."""
        return self._active

    def record(self, layer: int) -> None:
        """A token exited after `layer`."""
        self.recent.append(layer)
        self._active = self._union()
