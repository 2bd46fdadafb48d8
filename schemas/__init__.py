"""Artifact schemas (one Arrow schema per artifact kind) with validated, atomic read and write."""

from .artifacts import SCHEMAS, VERSION, ArtifactError, ArtifactSpec, Col
from .footer import artifact_kind, artifact_metadata, artifact_parts
from .io import check_artifact, read_artifact, read_columns, write_artifact, write_artifact_parts
from .locations import (
    STDIO,
    OutputRefused,
    check_output,
    check_output_dir,
    input_name,
    input_path,
    output_target,
    spool_input,
)

__all__ = ["SCHEMAS", "STDIO", "VERSION", "ArtifactError", "ArtifactSpec", "Col", "OutputRefused",
           "artifact_kind", "artifact_metadata", "artifact_parts", "check_artifact", "check_output",
           "check_output_dir", "input_name", "input_path", "output_target", "read_artifact", "read_columns",
           "spool_input", "write_artifact", "write_artifact_parts"]
