"""Artifact schemas (one Arrow schema per artifact kind) with validated, atomic read and write."""

from .artifacts import SCHEMAS, VERSION, ArtifactError, ArtifactSpec, Col
from .io import (
    artifact_kind,
    artifact_metadata,
    artifact_parts,
    read_artifact,
    write_artifact,
    write_artifact_parts,
)

__all__ = ["SCHEMAS", "VERSION", "ArtifactError", "ArtifactSpec", "Col", "artifact_kind", "artifact_metadata",
           "artifact_parts", "write_artifact_parts",
           "read_artifact", "write_artifact"]
