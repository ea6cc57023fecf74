"""No module reads another module's private members: every `x._name` (not a dunder), `getattr(x, "_name")` and
`from m import _name` in artnb reads from `self`, `cls`, `super()` or a module-level name of the same module, or
reads a member the module itself defines (a private method or field of one of its classes, on another instance).

Why: a layer that reaches into another's `_fields` breaks silently when that module changes them; what a module
offers others is its public names (see core/contracts.py). The import layers themselves are checked by
`lint-imports` (pyproject.toml [tool.importlinter]); this test covers what an import graph cannot see.
"""

from __future__ import annotations

import ast
from pathlib import Path

import artnb

PACKAGE = Path(artnb.__file__).parent

# (module path relative to artnb/, attribute) -> why it cannot be otherwise
ALLOWED = {
    (
        "core/ignored.py",
        "_getframe",
    ): "sys._getframe: the caller's frame, to warn at the user's line (stdlib)",
    ("cli.py", "_SubParsersAction"): "argparse's subcommand type, for an annotation (stdlib)",
    ("backends/engines/hf/server.py", "_exit"): "os._exit: leave a forked engine child at once (stdlib)",
    ("backends/trainers/fsdp_rank.py", "_exit"): "os._exit: a training rank's child leaves at once (stdlib)",
    ("integrations/langfuse_traces.py", "_otel_tracer"): "spans with explicit start times need the Langfuse "
    "SDK's own tracer; it has no public accessor",
    ("integrations/langfuse_traces.py", "_artnb_langfuse"): "a marker this module sets on its own wrapper of "
    "a client's `create`, so a client is wrapped once",
    (
        "integrations/trackio_run.py",
        "_config_logged",
    ): "Trackio sends a run's config once; resetting its flag is the only way to send an updated config",
    ("utils/strip_logprobs.py", "_fields"): "namedtuples' public API is spelled `_fields` (stdlib)",
    ("backends/engines/hf/slots.py", "_attn_implementation"): "transformers picks a model's attention "
    "function from `config._attn_implementation` at each forward pass; its public setter "
    "(`set_attn_implementation`) walks every module, too slow to switch for each decode step",
    ("backends/server.py", "_experimental_fork_checkpoint"): "ART's public API spells it with an underscore "
    "(`backend._experimental_fork_checkpoint`)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Names the module defines at module level (functions, classes, assignments), not the names it imports."""
    names = {"self", "cls"}
    for statement in tree.body:
        nodes = ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _own_members(tree: ast.Module) -> set[str]:
    """Private members the module's own classes define: in a class body, or assigned to `self.<name>`."""
    members = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    members |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                members.add(node.attr)
    return {m for m in members if _private(m)}


def _is_own(value: ast.expr, own: set[str]) -> bool:
    if isinstance(value, ast.Name):
        return value.id in own
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def private_reads(source: str) -> list[tuple[int, str, str]]:
    """(line, what is read from, private name) of each read of another module's private member in `source`."""
    tree = ast.parse(source)
    own, members = _own_names(tree), _own_members(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in members:
            continue
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_own(node.value, own):
            found.append((node.lineno, ast.unparse(node.value), node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in members
            and not _is_own(node.args[0], own)
        ):
            found.append((node.lineno, ast.unparse(node.args[0]), node.args[1].value))
        elif isinstance(node, ast.ImportFrom):
            where = "." * node.level + (node.module or "")
            found += [(node.lineno, where, a.name) for a in node.names if _private(a.name)]
    return found


def test_private_reads_are_found():
    source = (
        "import sys\nfrom .x import _y\nclass A:\n    _n = 1\n    def f(self, other, a: A):\n"
        "        return self._n, A._n, super()._n, a._n, other._m, getattr(other, '_k'), sys._getframe()\n"
    )
    assert {(what, name) for _, what, name in private_reads(source)} == {
        (".x", "_y"),
        ("other", "_m"),
        ("other", "_k"),
        ("sys", "_getframe"),
    }


def test_no_module_reads_another_modules_private_members():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for line, what, name in private_reads(path.read_text(encoding="utf-8")):
            if (module, name) not in ALLOWED:
                problems.append(f"artnb/{module}:{line}: {what}.{name}")
    assert not problems, "reads of another module's private members:\n" + "\n".join(problems)


def test_every_allowed_read_still_exists():
    """An allowance whose read is gone is removed, so the list only says what is still needed."""
    reads = {
        (path.relative_to(PACKAGE).as_posix(), name)
        for path in PACKAGE.rglob("*.py")
        for _, _, name in private_reads(path.read_text(encoding="utf-8"))
    }
    assert set(ALLOWED) <= reads, set(ALLOWED) - reads
