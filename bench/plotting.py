"""Saving a figure, for the sweep's report and the oracle's: files only (the Agg backend, no
display), one size and resolution for every plot."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, out: Path, name: str) -> Path:
    fig.tight_layout()
    p = Path(out) / f"{name}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
