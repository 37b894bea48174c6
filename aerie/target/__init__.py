"""The target (verifier) model: loading, feature taps, and the tiny default target."""

from aerie.target.model import Target, eagle3_tap_layers, load_target

__all__ = ["Target", "eagle3_tap_layers", "load_target"]
