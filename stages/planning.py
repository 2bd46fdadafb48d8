"""What `plan-schedule` resolves before it plans: the model's shape, the threshold and tail quantile (given,
calibrated or the prior), the cost model (measured or a hardware preset) and the tail profile (measured,
or the reference profile of a published schedule) with the generation length it is planned for.

Torch-free for presets, so planning for a Qwen3 preset starts in a fraction of a second. Every refusal is
a ScheduleError (or CostError) whose message is one sentence.
"""

from __future__ import annotations

from pathlib import Path

from sparrow.schemas import artifact_metadata, read_artifact

from .calibrate import shipped_threshold
from .cost import analytic, load_cost
from .definitions import PRIOR_THRESHOLD, TAIL_QUANTILE
from .model.presets import PRESETS
from .published_schedules import REFERENCE_GEN_LEN, published_models
from .reference_profiles import QUANTILE, reference_profile
from .schedule import ScheduleError, TailProfile, check_quantile, check_threshold, measured_profile


def model_shape(spec: str):
    """(ModelConfig, name); presets resolve without importing torch, so planning starts fast."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()].config, spec.lower()
    from .model.loading import model_name, resolve_config  # torch, only for a checkpoint

    return resolve_config(spec), model_name(spec)


def resolve_threshold(threshold: float | None, threshold_file: Path | None,
                      quantile: float | None, model: str | None = None) -> tuple[float, float, str]:
    """(threshold, quantile, where it came from): given, from a threshold artifact, the calibration
    shipped for `model` (a preset name) at this quantile, or the published prior."""
    source = "prior" if threshold is None else "given"
    if threshold is None and threshold_file is None:
        shipped = shipped_threshold(model, TAIL_QUANTILE if quantile is None else quantile)
        if shipped is not None:
            threshold, source = shipped.threshold, shipped.note
    if threshold_file is not None:
        row = read_artifact(threshold_file, "threshold").to_pylist()
        if len(row) != 1:
            raise ScheduleError(f"{threshold_file} has {len(row)} rows, expected one threshold")
        threshold, source = row[0]["threshold"], f"{row[0]['source']}, {threshold_file}"
        if quantile is not None and abs(quantile - row[0]["quantile"]) > 1e-12:
            raise ScheduleError(f"--quantile {quantile:g} differs from the quantile {row[0]['quantile']:g} "
                                f"that {threshold_file} was calibrated at")
        quantile = row[0]["quantile"]
    threshold = PRIOR_THRESHOLD if threshold is None else threshold
    check_threshold(threshold)
    quantile = TAIL_QUANTILE if quantile is None else quantile
    check_quantile(quantile)
    return threshold, quantile, source


def load_cost_model(cfg, cost: Path | None, hardware: str | None):
    return load_cost(cost, cfg) if cost is not None else analytic(cfg, hardware or "h100")


def load_profile(name: str, profile: Path | None, quantile: float, bin_width: int | None,
                 prompt_len: int | None, gen_len: int | None, min_tokens: int
                 ) -> tuple[TailProfile, int, int]:
    """The tail profile, and the prompt and generation lengths it is planned for: given, else for a
    measured profile those its trajectories span (the shortest prompt, then up to the last profiled
    position, so that every profiled bin is planned), else 0 and the published generation length."""
    if profile is None:
        tails = reference_profile(name)
        if tails is None:
            raise ScheduleError(
                f"{name} has no reference profile (published schedules exist only for "
                f"{', '.join(published_models())}), so run `sparrow profile --model {name} ...` first "
                "and pass its output with --profile")
        if abs(quantile - QUANTILE) > 1e-12:
            raise ScheduleError(f"the reference profile is the published {QUANTILE:g} quantile of alpha; "
                                f"--quantile {quantile:g} needs a measured --profile")
        if bin_width is not None and bin_width != tails.bin_width:
            raise ScheduleError(f"the reference profile has {tails.bin_width}-token bins; --bin-width "
                                f"{bin_width} needs a measured --profile")
        return tails, prompt_len or 0, gen_len or REFERENCE_GEN_LEN
    table = read_artifact(profile, "mismatch")
    if table.num_rows == 0:
        raise ScheduleError(f"{profile}: the mismatch profile has no tokens")
    meta = artifact_metadata(table)
    if meta.get("kv_compression"):
        raise ScheduleError(f"{profile} profiles {meta['kv_compression']} eviction budgets, and a per-bin "
                            f"schedule of them means nothing: eviction keeps a retained set that every later "
                            "bin inherits, so pick one --kv-budget from the profile's tails instead")
    width = bin_width or int(meta.get("bin_width", 2000))
    if prompt_len is None:  # a trajectory's first token sits at the position of its prompt's length
        prompt_len = int(table.column("position").to_numpy().min())
    if gen_len is None:
        gen_len = max(int(table.column("position").to_numpy().max()) + 1 - prompt_len, 2)
    num_bins = (prompt_len + gen_len - 1) // width + 1
    tails = measured_profile(table, quantile, width, num_bins, str(profile),
                             int(meta.get("page_size", 16)), min_tokens)
    return tails, prompt_len, gen_len

