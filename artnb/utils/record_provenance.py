"""ART's `art.utils.record_provenance`: note on a W&B run's newest LoRA artifact where its weights came from.

artnb keeps checkpoints in the run directory and uploads no LoRA artifacts to W&B itself, so this finds an
artifact only for runs whose checkpoints were logged to W&B as type "lora" (ART's serverless backend does, and so
may the user's own `wandb.log_artifact`). With none there yet it does nothing, as in ART. It needs the wandb
package and a W&B login.
"""

from __future__ import annotations

from typing import Any

PROVENANCE_KEY = "wandb.provenance"  # the metadata key ART's tools read


def record_provenance(run: Any, provenance: str) -> None:
    """Append `provenance` (e.g. "sft:dataset-v2") to the provenance list of the newest "lora" artifact named
    after `run` (a `wandb.Run`: its entity, project and name)."""
    record_provenance_for_artifact(
        entity=str(run.entity), project=str(run.project), name=str(run.name), provenance=provenance
    )


def record_provenance_for_artifact(*, entity: str, project: str, name: str, provenance: str) -> None:
    """`record_provenance` for the artifact `{entity}/{project}/{name}:latest` of type "lora"."""
    try:
        import wandb
        from wandb.errors import CommError
    except ImportError as error:
        raise ImportError("record_provenance needs the wandb package: pip install wandb") from error
    try:
        artifact = wandb.Api().artifact(f"{entity}/{project}/{name}:latest", type="lora")
    except CommError:
        return  # no such artifact yet
    artifact.metadata[PROVENANCE_KEY] = with_provenance(artifact.metadata.get(PROVENANCE_KEY), provenance)
    artifact.save()


def with_provenance(existing: Any, provenance: str) -> list[str]:
    """The provenance list after `provenance`: appended, unless it is already the last entry (so recording
    the same source at every step does not grow the list)."""
    entries = list(existing) if existing else []
    if not entries or entries[-1] != provenance:
        entries.append(provenance)
    return entries
