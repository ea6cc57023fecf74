"""Notebook panels over artnb's core objects: `import artnb.widgets` (or use `art.widgets`, loaded on first use).

- `PreflightView(await art.preflight(...))`: before step 1, whether the reward can teach: a verdict per check.
- `GroupView(group_or_groups)`: the trajectories as chats sorted by reward, tokens coloured by logprob.
- `RulerComparison(group_or_groups, judge=...)`: your reward beside RULER's score; edit the rubric, re-score.
- `TrainingPanel(model, rollout, scenarios)`: Gather, Score, Train step, Run N, Stop; live plot and groups.
- `ScenarioEditor(scenarios)`: AutoRL's generated scenarios as editable rows; `.scenarios` validates them.
- `RewardPlot(model_or_run_dir)`: mean reward (or any metric) per step with a spread band; given a model it
  redraws as the model records steps, given a run directory it redraws on `refresh()`.
- `OffPolicyPlot(model_or_run_dir)`: each step's policy lag and importance-ratio spread (pipelined training);
  live for a model like RewardPlot.

They are plain ipywidgets and plotly FigureWidgets (tested in JupyterLab 4.6 by tests/widgets/test_browser.py),
coloured with JupyterLab's theme variables where there are some, so a dark theme stays readable.
In Colab, importing this module turns on Colab's custom widget manager (needed for ipywidgets 8 and plotly's
FigureWidget there), so users need no extra cell.
"""

from __future__ import annotations


def enable_colab_widgets() -> bool:
    """Turn on Colab's custom widget manager when running in Colab; True if it did."""
    try:
        from google.colab import output  # type: ignore[import-not-found]
    except ImportError:
        return False
    output.enable_custom_widget_manager()
    return True


enable_colab_widgets()

from .group_view import GroupView  # noqa: E402
from .off_policy_plot import OffPolicyPlot  # noqa: E402
from .preflight_view import PreflightView  # noqa: E402
from .reward_plot import RewardPlot  # noqa: E402
from .ruler_comparison import RulerComparison  # noqa: E402
from .scenario_editor import ScenarioEditor  # noqa: E402
from .training_panel import TrainingPanel  # noqa: E402

__all__ = [
    "GroupView",
    "OffPolicyPlot",
    "PreflightView",
    "RewardPlot",
    "RulerComparison",
    "ScenarioEditor",
    "TrainingPanel",
    "enable_colab_widgets",
]
