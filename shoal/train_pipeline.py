"""`shoal train --pipeline`: a four-stage pipeline from the command line, its config from an env
id or a job.toml's [pipeline] table. A text environment (CodeGen-v1, Countdown-v1, ...) runs the
language-model pipeline (learner/lm_pipeline.py: synthesis → teacher SFT + student distillation →
async RL → pass@k evaluation); any other id the step pipeline (learner/pipeline.py:
demonstrations → distillation → PPO → evaluation).

The pipeline itself reports nothing while it runs; it rewrites pipeline.json after every stage,
so a watcher thread reads that file and prints each stage's line as soon as the stage is recorded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError
from shoal.learner.errors import PipelineError
from shoal.learner.lm_config import STAGES as LM_STAGES
from shoal.learner.lm_config import LMPipelineConfig
from shoal.learner.lm_records import read_manifest
from shoal.learner.pipeline import PipelineConfig, run_pipeline
from shoal.rundir import fresh_path

STAGES = ("demonstrations", "pretrain", "ppo", "evaluation")
# the metrics worth one line per stage; the rest stay in pipeline.json
SHOWN: dict[str, tuple[str, ...]] = {
    "demonstrations": ("steps", "episodes", "teacher_mean_return"),
    "pretrain": ("accuracy", "cross_entropy", "value_mse"),
    "ppo": ("env_steps", "updates", "mean_return_last20"),
    "evaluation": ("final.mean_return", "pretrained.mean_return", "final.success_rate"),
}
LM_SHOWN: dict[str, tuple[str, ...]] = {
    "synthesis": ("train_tasks", "heldout_tasks", "heldout_families_tasks"),
    "distillation": ("teacher.ce", "student.kl", "student.ce", "student.params",
                     "teacher.bf16", "student.bf16"),
    "rl": ("updates", "reward_first5", "reward_last5", "mean_staleness",
           "validation_student", "validation_selected", "selected_step"),
    "evaluation": ("teacher.heldout.pass_at.1", "student.heldout.pass_at.1",
                   "rl.heldout.pass_at.1", "rl_minus_student.heldout.difference",
                   "rl_minus_student.heldout.se"),
}  # fmt: skip
AnyPipelineConfig = PipelineConfig | LMPipelineConfig
WATCH_EVERY_S = 0.5
MAX_ENV_ID_CHARS = 128
"""An environment id at most: the longest registered one has 44 characters."""
ENV_ID_VARIABLE = "SHOAL_ENV_ID"


def is_job_file(target: str) -> bool:
    """Whether `target` names a job file rather than an environment id."""
    try:
        return target.endswith(".toml") or Path(target).is_file()
    except (OSError, ValueError):  # too long, or a NUL byte: no file, so an env id to check
        return False


def pipeline_config(
    target: str, seed: int | None, environ: Mapping[str, str] | None = None
) -> AnyPipelineConfig:
    """The pipeline's config from an env id or a job.toml's [pipeline] table, then SHOAL_*
    overrides, then --seed (the flag beats the environment, as in plain `shoal train`): an
    LMPipelineConfig for a text environment, else a PipelineConfig."""
    from shoal.config import check_int, load
    from shoal.envs.text_registry import is_text_env
    from shoal.learner.config import SEED_MAX

    if is_job_file(target):
        table = _pipeline_table(Path(target))
        if "env_id" not in table:
            raise ConfigError(
                f'{target}: [pipeline] has no env_id; add one, e.g. env_id = "GridWorld-v1"'
            )
        mapping, source = table, f"{target} [pipeline]"
    else:
        mapping, source = {"env_id": target}, "command line"
    if seed is not None:
        check_int("--seed", seed, 0, SEED_MAX)
    kind: type[AnyPipelineConfig] = (
        LMPipelineConfig if is_text_env(str(mapping["env_id"])) else PipelineConfig
    )
    cfg = load(kind, mapping, source=source, environ=environ)
    _check_env_id_length(cfg.env_id, source, os.environ if environ is None else environ)
    return cfg if seed is None else dataclasses.replace(cfg, seed=seed)


def _check_env_id_length(env_id: str, source: str, environ: Mapping[str, str]) -> None:
    """Refuse an id far longer than any environment's (a pasted file, say): every later
    message would echo it whole."""
    if len(env_id) > MAX_ENV_ID_CHARS:
        origin = f"environment variable {ENV_ID_VARIABLE}" if ENV_ID_VARIABLE in environ else source
        raise ConfigError(
            f"{origin}: pipeline.env_id = {env_id!r:.60}... is {len(env_id)} characters long, "
            f"over {MAX_ENV_ID_CHARS}; use an environment id such as GridWorld-v1"
        )


def _pipeline_table(path: Path) -> dict[str, Any]:
    from shoal.config import read_toml

    tables = read_toml(path)
    table = tables.get("pipeline")
    if not isinstance(table, dict):
        raise ConfigError(
            f"{path}: no [pipeline] table; --pipeline reads its settings from one "
            "(see docs/pipeline.md)"
        )
    stray = sorted(set(tables) - {"pipeline"})
    if stray:
        raise ConfigError(
            f"{path}: [{stray[0]:.60}] is outside [pipeline], and --pipeline reads nothing "
            f"else; did you mean {_within_pipeline(stray[0], tables[stray[0]])}?"
        )
    return table


def _within_pipeline(key: str, value: Any) -> str:
    """Where a top-level table of a pipeline job belongs: `[pipeline.eval]` for a misspelt
    `[pipelin.eval]`, `[pipeline.rl]` for `[rl]`."""
    if not difflib.get_close_matches(key, ["pipeline"], n=1, cutoff=0.6):
        return f"[pipeline.{key:.60}]"
    tables = (
        [name for name, sub in value.items() if isinstance(sub, dict)]
        if isinstance(value, dict)
        else []
    )
    return f"[pipeline.{tables[0]:.60}]" if tables else "[pipeline]"


def default_run_dir(env_id: str, root: Path = Path("runs")) -> Path:
    """runs/<UTC timestamp>-pipeline-<env>[-n], never an existing directory."""
    return fresh_path(root, f"pipeline-{env_id}")


def _metric(metrics: Mapping[str, Any], dotted: str) -> Any:
    value: Any = metrics
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _number(value: Any) -> str:
    if isinstance(value, bool):  # a choice the stage made, e.g. stage 2's precision per model
        return str(value).lower()
    if not isinstance(value, int | float):
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def stage_line(stage: Mapping[str, Any]) -> str:
    """One human line for a recorded stage: its number, name, time and headline metrics."""
    name = str(stage.get("name", "?"))
    names, keys = (LM_STAGES, LM_SHOWN) if name in LM_STAGES else (STAGES, SHOWN)
    number = names.index(name) + 1 if name in names else 0
    metrics = stage.get("metrics") or {}
    shown = ", ".join(f"{key} {_number(_metric(metrics, key))}" for key in keys.get(name, ()))
    if stage.get("reused"):
        return f"stage {number}/{len(names)} {name:<14} reused (outputs checked)"
    wall = float(stage.get("wall_s") or 0.0)
    return f"stage {number}/{len(names)} {name:<14} {wall:7.2f}s  {shown}".rstrip()


def finite(value: Any) -> Any:
    """`value` with every NaN/inf float replaced by None, so it serialises as strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class StageWatcher:
    """Calls `emit` once per stage as pipeline.json records it (from a thread, or by `poll`).

    A pipeline.json already there when the watcher starts is an earlier run's (or a hostile
    file): it is never shown, only a file written since. Whatever the file holds, a read gives
    well-formed stages or none (`read_manifest`): the pipeline, not the watcher, reports what
    is wrong with a record."""

    def __init__(self, manifest: Path, emit: Callable[[dict[str, Any]], None]) -> None:
        self.manifest = manifest
        self.emit = emit
        self.seen = 0
        self._earlier = _identity(manifest)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stage-watcher", daemon=True)

    def poll(self) -> None:
        with self._lock:
            stages = self._read()
            for stage in stages[self.seen :]:
                self.emit(stage)
            self.seen = max(self.seen, len(stages))

    def _read(self) -> list[dict[str, Any]]:
        # written atomically (rename), so a read sees a whole file or none
        if _identity(self.manifest) == self._earlier:
            return []
        try:
            return list(read_manifest(self.manifest)["stages"])
        except PipelineError:
            return []

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            self.poll()

    def __enter__(self) -> StageWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the thread, then catch up: the last stage (or the one before a failure)."""
        self._stop.set()
        self._thread.join()
        self.poll()


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a rewritten file from the one seen before (an atomic rewrite is a new
    inode); None when there is none."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def outputs_of(manifest: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    """Absolute paths of the evaluation reports a finished run wrote, by output name."""
    for stage in manifest.get("stages", []):
        if stage.get("name") == "evaluation":
            return {k: str(run_dir / v["path"]) for k, v in stage.get("outputs", {}).items()}
    return {}


def run(
    cfg: AnyPipelineConfig,
    run_dir: Path | None,
    emit: Callable[[str], None],
    from_stage: str | None = None,
) -> dict[str, Any]:
    """Run the pipeline (from `from_stage` of the run in `run_dir`, for the LM pipeline),
    emitting each stage's line as it lands; the JSON-safe summary."""
    if from_stage is not None and (run_dir is None or not isinstance(cfg, LMPipelineConfig)):
        raise ConfigError(
            "--from-stage reruns a stage of a text environment's pipeline (e.g. CodeGen-v1) "
            "in an existing run: give that run's --run-dir"
        )
    root = default_run_dir(cfg.env_id) if run_dir is None else run_dir
    manifest_path = root / "pipeline.json"
    started = time.perf_counter()
    start = _start(cfg, root, from_stage)
    watcher = StageWatcher(manifest_path, lambda stage: emit(stage_line(stage)))
    try:
        with watcher:
            manifest = start()
    except BaseException:
        if run_dir is None and watcher.seen == 0:
            # a mistake before stage 1 (no teacher, unknown id): leave no empty run behind
            shutil.rmtree(root, ignore_errors=True)
        raise
    reports = outputs_of(manifest, root)
    return finite(
        {
            "env_id": cfg.env_id,
            "seed": cfg.seed,
            "run_dir": str(root),
            "pipeline_json": str(manifest_path),
            "report": reports.get("final_json", reports.get("report_json")),
            "report_html": reports.get("final_html", reports.get("report_html")),
            "pretrained_report": reports.get("pretrained_json"),
            "wall_s": time.perf_counter() - started,
            "stages": [
                {"name": s["name"], "wall_s": s["wall_s"], "metrics": s["metrics"]}
                for s in manifest["stages"]
            ],
        }
    )


def _start(
    cfg: AnyPipelineConfig, root: Path, from_stage: str | None
) -> Callable[[], dict[str, Any]]:
    """The pipeline's run, its plan checked now: a bad --from-stage or a bad record of the run
    being reused is refused before the watcher starts, so before any stage line."""
    if isinstance(cfg, LMPipelineConfig):
        from shoal.learner.lm_pipeline import plan_rerun, run_planned

        plan = plan_rerun(root, from_stage)
        return lambda: run_planned(cfg, root, plan)
    return lambda: run_pipeline(cfg, root)
