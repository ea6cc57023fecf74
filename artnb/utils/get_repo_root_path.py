"""`art.utils.get_repo_root_path`: where ART's benchmark notebooks write their charts (`{root}/assets/...`)."""

from __future__ import annotations

from pathlib import Path


def get_repo_root_path() -> str:
    """The git repository the notebook runs in: the nearest directory at or above the working directory that
    holds `.git`; "." outside any. ART looks above its own installed package, which is the user's repository only
    for a source checkout of ART; the working directory's repository is the notebook's in every install."""
    here = Path.cwd()
    for directory in (here, *here.parents):
        if (directory / ".git").exists():
            return str(directory)
    return "."
