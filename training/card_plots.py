"""Plots of a model card (card.json, training/train.py save_model): gain importance and the
validation calibration. matplotlib's object-oriented API and the Agg renderer: no pyplot state,
no display."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Importance beyond the top features is a long tail of zeros: it only makes the bars unreadable.
TOP_FEATURES = 20


def plot_importance(card: dict[str, Any], path: Path, top: int = TOP_FEATURES) -> Path:
    """Horizontal bars of the card's feature_importance_gain (share of total gain), largest on
    top."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    gains = sorted(card["feature_importance_gain"].items(), key=lambda kv: kv[1], reverse=True)
    shown = gains[:top][::-1]
    fig = Figure(figsize=(8, 0.3 * len(shown) + 1.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.barh([name for name, _ in shown], [share for _, share in shown], color="C0")
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("share of total split gain")
    ax.set_title(f"Feature importance of {card.get('name', 'the model')} (top {len(shown)})")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path)
    return path


def plot_calibration(card: dict[str, Any], path: Path) -> Path:
    """The card's calibration_valid: observed rate against mean predicted probability per bin,
    the diagonal being perfect calibration; point area grows with the bin's rows."""
    from matplotlib.figure import Figure

    bins = [b for b in card["calibration_valid"] if b["rows"] > 0]
    fig = Figure(figsize=(6, 6), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    most = max((b["rows"] for b in bins), default=1)
    ax.plot(
        [b["mean_predicted"] for b in bins],
        [b["observed_rate"] for b in bins],
        color="C0",
        marker=None,
        label="model",
    )
    ax.scatter(
        [b["mean_predicted"] for b in bins],
        [b["observed_rate"] for b in bins],
        s=[20 + 200 * b["rows"] / most for b in bins],
        color="C0",
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean predicted P(return within horizon)")
    ax.set_ylabel("observed return rate")
    ax.set_title(f"Calibration of {card.get('name', 'the model')} on its validation rows")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)
    return path
