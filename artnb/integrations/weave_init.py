"""`init_weave`: `weave.init` that cannot stop a training notebook.

Why it exists: ART's notebooks call `weave.init(project)` in their first cells. When W&B cannot be reached
(offline machine, a wrong WANDB_BASE_URL, a proxy that swallows requests) weave 0.54 raises a bare transport
error (`gql.transport.exceptions.TransportConnectionFailed: [Errno 111] Connection refused`, or `timed out`
after seconds of waiting), which stops the cell and everything after it, although `@weave.op` functions run
fine without Weave. `init_weave` runs `weave.init` in a worker thread for at most `timeout_s` seconds and turns
a failure into one clear warning: the loop goes on, untraced.

    from artnb.integrations.weave_init import init_weave
    init_weave(model.project, global_postprocess_output=art.utils.strip_logprobs)

Weave starting in a worker thread (here, and in the W&B reporter's thread, where `wandb.init` starts Weave when
weave is imported) must first call `import_what_weave_imports_late()`: see its docstring.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from typing import Any

from ..core.ignored import warn_user


def init_weave(project: str, timeout_s: float = 30.0, **kwargs: Any) -> Any | None:
    """`weave.init(project, **kwargs)`, bounded by `timeout_s`: the WeaveClient, or None (with a warning) when
    Weave could not start. A timed-out init keeps trying in the background and may still start tracing."""
    import weave

    outcome: dict[str, Any] = {}

    def start() -> None:
        try:
            outcome["client"] = weave.init(project, **kwargs)
        except BaseException as error:  # weave may raise anything from its transport (or SystemExit)
            outcome["error"] = error

    import_what_weave_imports_late()
    worker = threading.Thread(target=start, name="artnb-weave-init", daemon=True)
    worker.start()
    worker.join(timeout_s)
    where = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    if worker.is_alive():
        problem = f"did not finish within {timeout_s:g} s"
    elif "error" in outcome:
        error = outcome["error"]
        problem = f"failed ({type(error).__name__}: {str(error)[:200]})"
    else:
        return outcome["client"]
    warn_user(
        f"artnb: weave.init({project!r}) {problem}: W&B at {where} is unreachable or rejected the API key "
        "(WANDB_API_KEY). Weave tracing is off; @weave.op functions still run and training goes on."
    )
    return None


def import_what_weave_imports_late() -> None:
    """Import `httpx2` (when installed) in the calling thread, before Weave starts in another.

    Weave's init imports httpx2 on its way to W&B (gql's httpx transport). openai (2.5x) looks up
    `sys.modules["httpx2"]` on every response it parses, without the import lock, so while another thread is
    importing httpx2 a rollout can find it half-made and fail with "partially initialized module 'httpx2' has no
    attribute 'Response'" (seen in our CI: a W&B run started Weave while the next group was gathered). Imported
    whole here first, there is no such moment."""
    if importlib.util.find_spec("httpx2") is not None:
        importlib.import_module("httpx2")
