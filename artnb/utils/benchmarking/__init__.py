"""Benchmarking helpers with ART's call shapes: load every logged trajectory as a table, chart a metric.

    from artnb.utils.benchmarking.load_trajectories import load_trajectories
    from artnb.utils.benchmarking.charts import training_progress_chart
    from artnb.utils.benchmarking.types import BenchmarkModelKey

pandas tables and plotly figures where ART uses polars and matplotlib (see each module's docstring).
"""

from .charts import BenchmarkFigure, percentage_comparison_bar_chart, training_progress_chart
from .filter_model_split import filter_rename_model_split
from .load_trajectories import load_trajectories
from .types import BenchmarkModelKey

__all__ = [
    "BenchmarkFigure",
    "BenchmarkModelKey",
    "filter_rename_model_split",
    "load_trajectories",
    "percentage_comparison_bar_chart",
    "training_progress_chart",
]
