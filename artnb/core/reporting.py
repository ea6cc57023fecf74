"""Where a model tells observability tools what it recorded, without core knowing which tools exist.

Design choices, and why:
- A registry, filled from above: artnb/integrations registers one factory per tool (W&B, Trackio, Langfuse)
  when it is imported, and `import artnb` imports it. So core imports nothing above it, and a user sees no change.
- Each model has one `ModelReporting` (`model.reporting`): its reporters are chosen once, on first use, by
  asking every factory (None: not asked for, nothing imported, no network), and kept until `close()`.
- The model emits two events: `row_logged` after each history row is recorded (a train step's row, `model.log`
  rows, the metrics merged into a trained step; with the groups behind it and, for a training step, its
  config) and `client_created` for each OpenAI client `model.openai_client()` makes, so a tracer sees every
  chat completion. A reporter started after the client was made is given that client when it starts.
- A reporter that fails warns once per model and is never allowed to stop training.
- Row listeners (`model.reporting.on_row(fn)`) are for views in the same process, e.g. a live RewardPlot: they
  are called after the reporters with each recorded row; a bound method is held weakly (a plot nobody shows any
  more is not kept alive by the model it plots). Like reporters, they warn once when they fail, never stopping
  training.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .ignored import warn_user

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .model import Model
    from .trajectory import TrajectoryGroup


class Reporter(Protocol):
    name: str  # e.g. "W&B", in messages
    url: str | None  # where a person sees what it recorded (the W&B run, the Langfuse project), once known

    def log_row(
        self, model: Model, row: dict[str, Any], groups: Sequence[TrajectoryGroup], config: BaseModel | None
    ) -> None:
        """A history row was recorded (`row["split"]`, `row["step"]`, metrics), with its groups (maybe none) and,
        for a training step, the TrainConfig or TrainSFTConfig it ran with."""

    def instrument(self, model: Model, client: Any) -> None:
        """`client` (an AsyncOpenAI) was made for `model`: hook its requests if this reporter traces them."""

    def close(self) -> None: ...


ReporterFactory = Callable[["Model"], "Reporter | None"]  # a model's reporter, or None when not asked for
RowListener = Callable[[dict[str, Any]], None]  # called with each history row the model records


@dataclass(frozen=True)
class _Registered:
    factory: ReporterFactory
    metric_name: str | None  # what `report_metrics=[...]` names it by, if it is chosen that way
    chosen_by: (
        str | None
    )  # how it is chosen otherwise, said in the message for an unknown report_metrics name


_registry: dict[str, _Registered] = {}  # name (in warnings) -> factory, in registration order


def register(
    name: str, factory: ReporterFactory, *, metric_name: str | None = None, chosen_by: str | None = None
) -> None:
    """Let every model ask `factory` for a reporter (registering a name again replaces it).

    `metric_name`: what `Model(report_metrics=[...])` names it by ("wandb"); `chosen_by`: how it is chosen
    instead ("Langfuse, by its keys"). Example: `register("my_tracker", lambda model: None, metric_name="mine")`.
    """
    _registry[name] = _Registered(factory, metric_name, chosen_by)


def metric_names() -> tuple[str, ...]:
    """What `report_metrics=[...]` may name (registered by artnb/integrations: "wandb", "trackio")."""
    return tuple(r.metric_name for r in _registry.values() if r.metric_name)


def what_reports() -> str:
    """Says what artnb reports to, for the warning about a `report_metrics` name it does not know."""
    others = [r.chosen_by for r in _registry.values() if r.chosen_by]
    return f"artnb reports to {' and '.join(map(repr, metric_names()))}" + (
        f" (and {', '.join(others)})" if others else ""
    )


class ModelReporting:
    """One model's reporters: chosen from the registry on first use, kept until `close()`."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._reporters: list[Reporter] | None = None
        self._client: Any = None  # the model's newest OpenAI client, for reporters started after it was made
        self._warned: set[str] = set()
        self._row_listeners: list[
            Callable[[], RowListener | None]
        ] = []  # each gives its listener, or None once gone

    def reporters(self) -> list[Reporter]:
        """The model's reporters, started on first use."""
        if self._reporters is None:
            started: list[Reporter] = []
            for name, registered in list(_registry.items()):
                try:
                    reporter = registered.factory(self.model)
                except Exception as error:  # a broken integration must not stop training
                    self._warn_once(name, f"could not start ({type(error).__name__}: {error})")
                    continue
                if reporter is not None:
                    started.append(reporter)
            self._reporters = started
            if self._client is not None:  # made before these reporters were asked for (or before a close)
                for reporter in started:
                    self._instrument(reporter, self._client)
        return self._reporters

    def started(self) -> list[Reporter]:
        """The reporters running now, without starting any."""
        return list(self._reporters or ())

    def on_row(self, listener: RowListener) -> None:
        """Call `listener(row)` after each history row the model records (train steps, `model.log`).

        A bound method is held weakly, so it is called while its object (e.g. a plot) lives; any other callable
        is kept. Example: `model.reporting.on_row(lambda row: print(row["step"], row.get("train/reward")))`."""
        if inspect.ismethod(listener):
            self._row_listeners.append(weakref.WeakMethod(listener))
        else:
            self._row_listeners.append(lambda: listener)

    def row_logged(
        self, row: dict[str, Any], groups: Sequence[TrajectoryGroup] = (), config: BaseModel | None = None
    ) -> None:
        """A history row was recorded (a train step's row with its `config`, or a `model.log` row)."""
        for reporter in self.reporters():
            try:
                reporter.log_row(self.model, row, groups, config)
            except Exception as error:
                self._warn_once(
                    reporter.name,
                    f"failed to record step {row.get('step')} ({type(error).__name__}: {error})",
                )
        alive = [(ref, listener) for ref in self._row_listeners if (listener := ref()) is not None]
        self._row_listeners = [ref for ref, _ in alive]
        for _, listener in alive:
            try:
                listener(row)
            except Exception as error:
                self._warn_once(
                    f"row listener {getattr(listener, '__qualname__', repr(listener))}",
                    f"failed on step {row.get('step')} ({type(error).__name__}: {error})",
                )

    def client_created(self, client: Any) -> Any:
        """`client` was made for the model: every reporter may hook it. Returns the client."""
        starting = self._reporters is None
        self._client = client
        for reporter in self.reporters():
            if not starting:  # starting reporters were given the client as they started
                self._instrument(reporter, client)
        return client

    def links(self) -> list[tuple[str, str]]:
        """(name, url) of each running reporter that has a page to show (the TrainingPanel links to them)."""
        return [(r.name, url) for r in self.started() if (url := getattr(r, "url", None))]

    def close(self) -> None:
        """Finish the reporters (a backend's close() does it); the next report starts them again."""
        found, self._reporters = self._reporters or [], None
        for reporter in found:
            try:
                reporter.close()
            except Exception as error:
                self._warn_once(reporter.name, f"did not close cleanly ({type(error).__name__}: {error})")

    def _instrument(self, reporter: Reporter, client: Any) -> None:
        try:
            reporter.instrument(self.model, client)
        except Exception as error:
            self._warn_once(reporter.name, f"could not trace requests ({type(error).__name__}: {error})")

    def _warn_once(self, who: str, what: str) -> None:
        if who in self._warned:
            return
        self._warned.add(who)
        warn_user(f"artnb: {who} {what}; training goes on without it (this warning is shown once)")
