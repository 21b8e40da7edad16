"""The language-model pipeline: synthesis → teacher SFT + student distillation → async RL →
evaluation, each stage's outputs hashed into pipeline.json.

1. *Synthesis*: the text environment's rule engine writes train, validation, held-out,
   held-out-family and perturbed held-out tasks (prompt, reference solution, hidden tests) as
   JSONL; every reference is scored by the environment (the sandbox for code), so a broken
   generator fails here.
2. *Distillation*: a teacher LM learns the references by cross-entropy, then a smaller student
   learns the teacher's next-token distributions (forward KL on logits, learner/distill.py).
3. *RL*: the student improves on sandbox rewards, asynchronously: a worker thread generates and
   scores while the learner updates (learner/lm_rl.py), on prompts of the environment's "rl"
   pool split where it has one (values SFT never saw); the checkpoint with the best validation
   pass@1 is kept, the student itself if no update beats it (learner/lm_validation.py).
4. *Evaluation*: pass@1/pass@k of teacher, student and RL policy on the held-out splits, with
   the failure breakdown, as report.json + report.html (learner/lm_eval.py).

Each stage reads only the previous stages' recorded outputs, checked against their sha256, so
`from_stage` reruns any stage (and those after it) from what the earlier ones left on disk.

Stages 2-4 run on one device (`pipeline.device`: the first GPU where there is one, else the
CPU), chosen before stage 1 and recorded in pipeline.json; on a GPU the forward passes of
SFT, distillation and the RL update run under bf16 autocast (`pipeline.mixed_precision`), on a
CPU with bf16 instructions those of a model's SFT or distillation where its steps measured
faster so.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal import boundedjson
from shoal.learner.cpu_features import native_bf16
from shoal.learner.distill import TokenBatch, fit, pack
from shoal.learner.errors import PipelineError, PolicyError
from shoal.learner.lm_config import AUTO, BPE, BYTES, STAGES, LMPipelineConfig
from shoal.learner.lm_records import (
    digest,
    open_regular,
    read_manifest,
    read_regular,
    verify,
)
from shoal.learner.lm_validation import (
    MAX_RECORD_BYTES,
    RECORD_KEYS,
    parse_record,
    validation_tasks,
)
from shoal.learner.models import build_model
from shoal.learner.models.causal_lm import CausalLMPolicy, export_pretrained, pretrained_config
from shoal.learner.parallel import rank_memory_bytes, training_bytes
from shoal.learner.pipeline import Recorder
from shoal.learner.precision_probe import ProbeResult, faster_precision, sft_step
from shoal.learner.sequence_collector import prompt_ids

EVAL_SPLITS = ("heldout", "heldout_families", "perturbed", "train_dist")
"""train_dist: fresh draws of the train split (train families and values; a prompt may repeat an
SFT one): what RL improves in distribution, beside what generalises."""
POLICIES = ("teacher", "student", "rl")
MAX_TASK_LINE = 1 << 20
"""A task's JSONL line at most (bytes): a file edited by hand is hostile input."""
MAX_TASK_FILE = 1 << 30
"""A task file at most (bytes): a line is about 500 bytes, so a million tasks (the most
`train_tasks` allows) fit twice over."""
TASK_DEPTH = 16
"""A task record nests four levels (task → tests → [call, expected] → a list value)."""


def stage_index(stage: str | int | None) -> int:
    """0-based index of a stage given by name or 1-based number (None: the first)."""
    if stage is None:
        return 0
    if isinstance(stage, int) or (isinstance(stage, str) and stage.isdigit()):
        number = int(stage)
        if 1 <= number <= len(STAGES):
            return number - 1
    elif stage in STAGES:
        return STAGES.index(stage)
    raise PipelineError(
        f"--from-stage {stage!r} is not a stage: use 1-{len(STAGES)} or one of {', '.join(STAGES)}"
    )


@dataclass(frozen=True)
class Rerun:
    """Where a run starts and the earlier stages' records it keeps, every output checked."""

    start: int
    kept: list[dict[str, Any]]


def plan_rerun(run_dir: str | Path, from_stage: str | int | None) -> Rerun:
    """The checked plan of a run from `from_stage`: made before anything runs or prints, so a
    bad stage or a bad record is refused before any stage line."""
    start = stage_index(from_stage)
    return Rerun(start, _previous_stages(Path(run_dir), start))


def run_lm_pipeline(
    cfg: LMPipelineConfig, run_dir: str | Path, from_stage: str | int | None = None
) -> dict[str, Any]:
    """Run the stages from `from_stage` on into `run_dir`; earlier stages' recorded outputs are
    checked and reused. Returns the manifest also written to pipeline.json."""
    return run_planned(cfg, run_dir, plan_rerun(run_dir, from_stage))


def run_planned(cfg: LMPipelineConfig, run_dir: str | Path, plan: Rerun) -> dict[str, Any]:
    """Run the stages from `plan.start` on into `run_dir`, after the records `plan` keeps."""
    root = Path(run_dir)
    place = Placement.of(cfg)
    root.mkdir(parents=True, exist_ok=True)
    rec = Recorder(root, cfg)  # type: ignore[arg-type]
    rec.manifest["kind"] = "lm"
    rec.manifest["device"] = str(place.device)
    rec.manifest["stages"] = list(plan.kept)
    rec.flush()
    for name in STAGES[plan.start :]:
        threads = cfg.fit_threads if name == "distillation" else cfg.torch_threads
        with _torch_threads(threads):
            torch.manual_seed(cfg.seed + STAGES.index(name))
            _RUNNERS[name](cfg, rec, place)
    return rec.manifest


def pick_device(spec: str, cuda_devices: int) -> str:
    """The device `pipeline.device` names on a machine where torch sees `cuda_devices` GPUs:
    "auto" takes the first GPU or the CPU; a GPU that is not there is a PipelineError."""
    if spec == AUTO:
        return "cuda:0" if cuda_devices else "cpu"
    if spec == "cpu":
        return spec
    index = int(spec.partition(":")[2] or 0)
    if index >= cuda_devices:
        seen = f"only {cuda_devices} CUDA device(s)" if cuda_devices else "no CUDA device"
        raise PipelineError(
            f"pipeline.device = {spec!r}, but torch sees {seen} (torch {torch.__version__}); "
            'use "auto" or "cpu", or run where that GPU is'
        )
    return f"cuda:{index}"


@dataclass(frozen=True)
class Placement:
    """Where stages 2-4 compute, and in what precision."""

    device: torch.device
    bf16: bool
    """Every training forward pass under bf16 autocast (a CUDA device with bf16,
    mixed_precision on)."""
    probe_fit: bool = False
    """A CPU with bf16 instructions, mixed_precision on: whether SFT's and distillation's
    forward passes autocast to bf16 is measured for each model (`fit_context`), since the
    flags do not tell whether it pays (learner/precision_probe.py). The RL update on a CPU
    stays float32: its log-probabilities are divided by the float32 sampler's, and bf16
    logits would put their rounding into every ratio."""

    @classmethod
    def of(cls, cfg: LMPipelineConfig) -> Placement:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = torch.device(pick_device(cfg.device, count))
        bf16 = device.type == "cuda" and cfg.mixed_precision and torch.cuda.is_bf16_supported()
        probe = device.type == "cpu" and cfg.mixed_precision and native_bf16()
        return cls(device, bf16, probe_fit=probe)

    def forward(self) -> AbstractContextManager[object]:
        """The context the RL update's forward passes run in."""
        return self._autocast(self.bf16)

    def fit_context(
        self, lm: nn.Module, batch: TokenBatch
    ) -> tuple[Callable[[], AbstractContextManager[object]], ProbeResult | None]:
        """The context `lm`'s SFT or distillation forward passes run in, and the timings that
        chose it where they were measured (a few steps of `lm` on `batch`, which stays as it
        was)."""
        if not self.probe_fit:
            return functools.partial(self._autocast, self.bf16), None
        probe = faster_precision(sft_step(lm, batch))
        return functools.partial(self._autocast, probe.bf16), probe

    def _autocast(self, on: bool) -> AbstractContextManager[object]:
        if on:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _previous_stages(root: Path, start: int) -> list[dict[str, Any]]:
    """The recorded stages before `start`, each output checked against its sha256. Each keeps
    the config it ran with (`config`): the run's top-level config is the one given now, which
    may differ (docs/pipeline.md, "Rerunning a stage")."""
    if start == 0:
        return []
    path = root / "pipeline.json"
    manifest = read_manifest(path)
    stages = manifest["stages"]
    names = [s["name"] for s in stages]
    if names[:start] != list(STAGES[:start]):
        raise PipelineError(
            f"cannot rerun from stage {start + 1} ({STAGES[start]}): {path} records "
            f"{names}, not {list(STAGES[:start])}; rerun from an earlier stage"
        )
    kept = [
        dict(s, reused=True, config=s.get("config", manifest["config"])) for s in stages[:start]
    ]
    for stage in kept:
        for output in stage["outputs"].values():
            verify(root, output, stage["name"])
    return kept


def _output(rec: Recorder, path: Path) -> dict[str, str]:
    return rec.output(path, digest(path))


def _input(rec: Recorder, stage: str, key: str) -> Path:
    for entry in rec.manifest["stages"]:
        if entry["name"] == stage and key in entry["outputs"]:
            return verify(rec.run_dir, entry["outputs"][key], stage)
    raise PipelineError(f"stage {stage} recorded no {key!r}; rerun from stage {stage}")


# -- tasks on disk -----------------------------------------------------------------------------


def _write_tasks(path: Path, tasks: Sequence[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(task_to_json(t), sort_keys=True) for t in tasks]
    path.write_text("".join(line + "\n" for line in lines))


def task_to_json(task: Any) -> dict[str, Any]:
    from shoal.envs.text_tasks import task_to_dict

    return task_to_dict(task)


def read_tasks(path: Path) -> list[Any]:
    """Tasks from a JSONL file stage 1 wrote: the file, each line and each line's nesting
    bounded before it is parsed, each task validated by the env module, at least one task
    (every split stage 1 writes has one)."""
    from shoal.envs.text_tasks import task_from_dict

    remedy = "rerun stage 1"
    tasks = []
    with open_regular(path, remedy) as handle:
        if os.fstat(handle.fileno()).st_size > MAX_TASK_FILE:
            raise PipelineError(f"{path} is larger than {MAX_TASK_FILE} bytes; {remedy}")
        for number, line in enumerate(iter(lambda: handle.readline(MAX_TASK_LINE + 1), b""), 1):
            if len(line) > MAX_TASK_LINE:
                raise PipelineError(f"{path}:{number}: a task line over {MAX_TASK_LINE} bytes")
            try:
                record = boundedjson.loads(line, max_bytes=MAX_TASK_LINE, max_depth=TASK_DEPTH)
                tasks.append(task_from_dict(record))
            except (ValueError, TypeError) as exc:
                raise PipelineError(f"{path}:{number}: not a task ({exc}); {remedy}") from None
    if not tasks:
        raise PipelineError(f"{path} holds no task; {remedy}")
    return tasks


# -- models ------------------------------------------------------------------------------------


def policy_spaces(vocab: int, positions: int) -> tuple[spaces.Box, spaces.Discrete]:
    """The token spaces a causal-lm policy over this vocabulary is built for."""
    return spaces.Box(0, vocab - 1, (positions,), np.int64), spaces.Discrete(vocab)


def new_policy(model_cfg: Any, tokenizer: Any, shapes_only: bool = False) -> CausalLMPolicy:
    """The policy `model_cfg` describes for this tokenizer; `shapes_only`: on the meta device
    where it can be (`CausalLMPolicy.deferred`, which also takes a `path` directory)."""
    from dataclasses import replace

    cfg = replace(model_cfg, vocab_size=int(tokenizer.vocab_size))
    obs, act = policy_spaces(cfg.vocab_size, cfg.max_positions)
    deferred = shapes_only and cfg.family == "causal-lm"
    policy = CausalLMPolicy.deferred(cfg, obs, act) if deferred else build_model(cfg, obs, act)
    if not isinstance(policy, CausalLMPolicy):
        raise PipelineError(f"model family {cfg.family!r} is not a causal LM")
    return policy


def check_memory(cfg: LMPipelineConfig, tokenizer: Any, place: Placement) -> None:
    """Refuse sizes whose training state alone outgrows the device (PipelineError naming
    them), before any weight is allocated: the teacher trains first (16 bytes a parameter:
    weight, gradient, AdamW's two moments), then the student beside the frozen teacher's
    weights. A lower bound (activations come on top), so what it refuses could never run."""
    teacher, student = (
        new_policy(m, tokenizer, shapes_only=True) for m in (cfg.teacher, cfg.student)
    )
    need = max(training_bytes(teacher), training_bytes(teacher) // 4 + training_bytes(student))
    have = rank_memory_bytes(place.device, 1)
    if need > have:
        raise PipelineError(
            f"[pipeline.teacher] ({_params(teacher):,} parameters) and [pipeline.student] "
            f"({_params(student):,}) need at least {need / 2**30:.1f} GiB to train, and "
            f"{place.device} has {have / 2**30:.1f} GiB: make them smaller"
        )


def load_policy(path: Path, tokenizer: Any) -> CausalLMPolicy:
    """A model a stage exported, quietly (no progress bar). Its config.json is read bounded and
    checked first (`pretrained_config`: sizes within the model LIMITS) and its vocabulary
    must be the tokenizer's, so the token spaces built from it stay small; a model that does
    not load is one PipelineError."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    remedy = f"rerun the stage that wrote {path}"
    vocab = int(tokenizer.vocab_size)
    try:
        config = pretrained_config(path)
        if config.vocab_size != vocab:
            raise PolicyError(f"its vocab_size {config.vocab_size} is not the tokenizer's {vocab}")
        obs, act = policy_spaces(vocab, int(config.max_position_embeddings))
        return CausalLMPolicy.from_pretrained(path, obs, act)
    except PolicyError as exc:
        raise PipelineError(f"{path}: the model does not load ({exc}); {remedy}") from None


def examples(tasks: Sequence[Any], env: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) per task: the prompt as every stage encodes it (BOS +
    prompt, learner/sequence_collector.py), the reference + EOS."""
    tokenizer = env.tokenizer
    prompts = [prompt_ids(t, env) for t in tasks]
    completions = [[*tokenizer.encode(t.reference), tokenizer.eos_id] for t in tasks]
    return prompts, completions


def _params(policy: CausalLMPolicy) -> int:
    return sum(p.numel() for p in policy.lm.parameters())


# -- the stages --------------------------------------------------------------------------------


def _make_env(cfg: LMPipelineConfig, tokenizer: str) -> Any:
    """The text environment, its completions as long as the longest any stage samples."""
    from shoal.envs.text_registry import make_text_env

    longest = max(cfg.rl.max_new_tokens, cfg.eval.max_new_tokens)
    return make_text_env(cfg.env_id, tokenizer=tokenizer, max_new_tokens=longest)


def _stage_env(cfg: LMPipelineConfig, rec: Recorder) -> Any:
    """The environment of a stage after synthesis: with the tokenizer stage 1 learnt and
    recorded when the config asks for one, else with the configured one."""
    if cfg.tokenizer != BPE:
        return _make_env(cfg, cfg.tokenizer)
    return _make_env(cfg, str(_input(rec, "synthesis", "tokenizer")))


def _env_hash(env: Any) -> str:
    from shoal.envs.text_registry import text_env_hash

    return text_env_hash(env)


def draw_splits(env: Any, cfg: LMPipelineConfig) -> dict[str, list[Any]]:
    """Every split stage 1 writes, from the environment's seeded streams (no scoring)."""
    splits = {
        "train": env.tasks("train", cfg.train_tasks, cfg.seed),
        "heldout": env.tasks("heldout", cfg.eval.tasks, cfg.seed),
        "heldout_families": env.tasks("heldout_families", cfg.eval.tasks, cfg.seed),
    }
    rng = np.random.default_rng(cfg.seed)
    splits["perturbed"] = [env.perturb(t, rng) for t in splits["heldout"]]
    splits["train_dist"] = env.tasks("train", cfg.eval.tasks, cfg.seed + 1)
    splits["validation"] = validation_tasks(env, cfg.rl.val_tasks, cfg.seed, splits.values())
    return splits


def _stage_synthesis(cfg: LMPipelineConfig, rec: Recorder, place: Placement) -> None:
    started = time.perf_counter()
    env = _make_env(cfg, BYTES if cfg.tokenizer == BPE else cfg.tokenizer)
    try:
        splits = draw_splits(env, cfg)
        every = [t for tasks in splits.values() for t in tasks]
        scores = env.score_many(every, [t.reference for t in every])
        digest_ = _env_hash(env)
    finally:
        env.close()
    failing = [t.id for t, s in zip(every, scores) if s.passed != s.total or s.total == 0]
    if failing:
        raise PipelineError(
            f"{cfg.env_id}: {len(failing)} reference solutions fail their own tests (first: "
            f"{failing[:3]}); the task generator is broken, report it"
        )
    outputs = {}
    for name, tasks in splits.items():
        path = rec.run_dir / "tasks" / f"{name}.jsonl"
        _write_tasks(path, tasks)
        outputs[name] = _output(rec, path)
    families = {name: sorted({t.family for t in tasks}) for name, tasks in splits.items()}
    metrics: dict[str, Any] = {f"{name}_tasks": len(tasks) for name, tasks in splits.items()}
    metrics |= {"families": families, "reference_pass_rate": 1.0}
    if cfg.tokenizer == BPE:
        digest_, outputs["tokenizer"], metrics["tokenizer"] = _learn_tokenizer(cfg, rec, splits)
    rec.stage("synthesis", started, digest_, outputs, metrics)


def _learn_tokenizer(
    cfg: LMPipelineConfig, rec: Recorder, splits: Mapping[str, Sequence[Any]]
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Learn the BPE from the train split's prompts and references only (no held-out text
    shapes the vocabulary); returns the environment hash with it, its output and its sizes."""
    from shoal.envs.tokenizer_training import train_bpe

    train = splits["train"]
    path = train_bpe([t.prompt for t in train] + [t.reference for t in train],
                     rec.run_dir / "tokenizer", cfg.bpe_vocab)  # fmt: skip
    env = _make_env(cfg, str(path))
    try:
        prompts, completions = examples(train, env)
        sizes = {
            "vocab_size": int(env.tokenizer.vocab_size),
            "fingerprint": env.tokenizer.fingerprint(),
            "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
            "mean_completion_tokens": float(np.mean([len(c) for c in completions])),
        }
        return _env_hash(env), _output(rec, path), sizes
    finally:
        env.close()


def _stage_distillation(cfg: LMPipelineConfig, rec: Recorder, place: Placement) -> None:
    started = time.perf_counter()
    env = _stage_env(cfg, rec)
    env.close()  # only its tokenizer and prompt encoding are needed here
    tokenizer = env.tokenizer
    tasks = read_tasks(_input(rec, "synthesis", "train"))
    prompts, completions = examples(tasks, env)
    check_memory(cfg, tokenizer, place)
    probe_batch = pack(prompts[: cfg.sft.batch_size], completions[: cfg.sft.batch_size],
                       tokenizer.pad_id).to(place.device)  # fmt: skip
    teacher = new_policy(cfg.teacher, tokenizer).to(place.device)
    teacher_forward, teacher_probe = place.fit_context(teacher.lm, probe_batch)
    t0 = time.perf_counter()
    teacher_fit = fit(teacher.lm, prompts, completions, tokenizer.pad_id, cfg.sft, seed=cfg.seed,
                      forward=teacher_forward)  # fmt: skip
    teacher_s = time.perf_counter() - t0
    student = new_policy(cfg.student, tokenizer).to(place.device)
    student_forward, student_probe = place.fit_context(student.lm, probe_batch)
    t0 = time.perf_counter()
    student_fit = fit(student.lm, prompts, completions, tokenizer.pad_id, cfg.distill,
                      seed=cfg.seed, teacher=teacher.lm, forward=student_forward)  # fmt: skip
    student_s = time.perf_counter() - t0
    outputs = {}
    for name, policy in (("teacher", teacher), ("student", student)):
        outputs[name] = _output(rec, export_pretrained(policy, rec.run_dir / "models" / name))
    metrics = {
        "teacher": {**teacher_fit, "params": _params(teacher), "wall_s": teacher_s,
                    **_precision(place, teacher_probe)},
        "student": {**student_fit, "params": _params(student), "wall_s": student_s,
                    **_precision(place, student_probe)},
        "tokenizer": tokenizer.fingerprint(),
        "device": str(place.device),
    }  # fmt: skip
    rec.stage("distillation", started, None, outputs, metrics)


def _precision(place: Placement, probe: ProbeResult | None) -> dict[str, Any]:
    """A model's stage-2 precision as pipeline.json records it: `bf16`, and the probe's step
    times where it was measured."""
    if probe is None:
        return {"bf16": place.bf16}
    return {"bf16": probe.bf16, "probe": probe.record()}


def _stage_rl(cfg: LMPipelineConfig, rec: Recorder, place: Placement) -> None:
    from shoal.learner.lm_rl import train_rl

    started = time.perf_counter()
    env = _stage_env(cfg, rec)
    student = load_policy(_input(rec, "distillation", "student"), env.tokenizer)
    student.to(place.device)
    tasks = read_tasks(_input(rec, "synthesis", "validation"))
    try:
        digest_ = _env_hash(env)
        validate = _validator(cfg, env, tasks)
        metrics = train_rl(student, env, digest_, cfg.rl, seed=cfg.seed, validate=validate,
                           forward=place.forward)  # fmt: skip
        metrics["device"] = str(place.device)
    finally:
        env.close()
    path = export_pretrained(student, rec.run_dir / "models" / "rl")
    curve = rec.run_dir / "rl" / "validation.json"
    curve.parent.mkdir(parents=True, exist_ok=True)
    curve.write_text(json.dumps({k: metrics[k] for k in sorted(RECORD_KEYS)}, indent=2) + "\n")
    outputs = {"rl": _output(rec, path), "validation": _output(rec, curve)}
    rec.stage("rl", started, digest_, outputs, metrics)


def _validator(cfg: LMPipelineConfig, env: Any, tasks: Sequence[Any]) -> Any:
    """policy -> pass@1 on the validation tasks, sampled as the evaluation samples, on the same
    seed each time, so two checkpoints are compared on the same random draws."""
    from shoal.learner.generation import SamplingConfig
    from shoal.learner.lm_eval import evaluate_split
    from shoal.learner.lm_sampling import sampler_for

    sampling = SamplingConfig(temperature=cfg.rl.val_temperature,
                              max_new_tokens=cfg.rl.max_new_tokens, stop=tuple(env.stop))  # fmt: skip

    def validate(policy: CausalLMPolicy) -> float:
        sample = sampler_for(policy, env, sampling, seed=cfg.seed)
        result = evaluate_split(env, "validation", tasks, sample, cfg.rl.val_samples, (1,))
        return result.pass_at["1"]

    return validate


def _stage_evaluation(cfg: LMPipelineConfig, rec: Recorder, place: Placement) -> None:
    from shoal.learner.lm_eval import compare, evaluate_policy, write_report
    from shoal.learner.lm_sampling import sampler

    started = time.perf_counter()
    splits = {name: read_tasks(_input(rec, "synthesis", name)) for name in EVAL_SPLITS}
    stage_of = {"teacher": "distillation", "student": "distillation", "rl": "rl"}
    env = _stage_env(cfg, rec)
    results = {}
    try:
        digest_ = _env_hash(env)
        for name in POLICIES:
            policy = load_policy(_input(rec, stage_of[name], name), env.tokenizer)
            policy.to(place.device)
            sample = sampler(policy, env, cfg.eval, seed=cfg.seed)
            results[name] = evaluate_policy(env, splits, sample, cfg.eval.samples, cfg.eval.ks)
    finally:
        env.close()
    meta = {"env_id": cfg.env_id, "env_hash": digest_, "seed": cfg.seed,
            "eval": asdict(cfg.eval)}  # fmt: skip
    record = _input(rec, "rl", "validation")
    validation = parse_record(read_regular(record, MAX_RECORD_BYTES, "rerun from stage rl"))
    json_path, html_path = write_report(results, meta, rec.run_dir / "report", validation)
    outputs = {"report_json": _output(rec, json_path), "report_html": _output(rec, html_path)}
    metrics: dict[str, Any] = {
        name: {split: {"pass_at": r.pass_at, "outcomes": r.outcomes} for split, r in by.items()}
        for name, by in results.items()
    }
    for d in compare(results):
        pair = metrics.setdefault(f"{d.policy}_minus_{d.baseline}", {})
        pair[d.split] = {"difference": d.difference, "se": d.se, "se_by_family": d.se_by_family}
    rec.stage("evaluation", started, digest_, outputs, metrics)


_RUNNERS = {
    "synthesis": _stage_synthesis,
    "distillation": _stage_distillation,
    "rl": _stage_rl,
    "evaluation": _stage_evaluation,
}
