"""ART's module path `art.skypilot.backend.SkyPilotBackend` (see backends/skypilot.py)."""

from ..backends.skypilot import SkyPilotBackend

__all__ = ["SkyPilotBackend"]
