"""ART's module path for the cloud backend: `from art.skypilot import SkyPilotBackend` (see backends/skypilot.py)."""

from ..backends.skypilot import SkyPilotBackend

__all__ = ["SkyPilotBackend"]
