"""`shoal bench learning`: learning quality in CleanRL's form — mean ± std of the final return
over seeds at one step budget, with wall time — for the families a new user tries after CartPole.

Each cell is a real `shoal train ID --seed S --max-env-steps B` (an embedded cluster, the
family's preset, no early stop at a target) in a subprocess; the final return is the mean of
the last 20 training episodes, as CleanRL reports its episodic return. Beside it: CleanRL's
published figure (its own, longer budget; cited per row) and, for the classic-control and MuJoCo
rows, the CleanRL-style loop of bench/cleanrl_ppo.py (ppo.py's or ppo_continuous_action.py's
settings) run here at the same budget and seeds, and with `--cleanrl DIR`, CleanRL's own
scripts from a checkout (bench/cleanrl_script.py): cleanrl/ppo.py for the classic-control rows,
cleanrl/ppo_continuous_action.py for the MuJoCo rows (at v4: its gymnasium 0.29 has no v5).
`python -m shoal.bench.learning --seeds 3` prints the markdown table docs/benchmarks.md records;
`--steps` changes the budget and `--trainer` runs one side only, so several processes can run
the sides at the same time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from shoal.bench import cleanrl_ppo, cleanrl_script
from shoal.bench.report import Row

CLEANRL = "CleanRL-style PPO"
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Task:
    """One row: what `shoal train` gets, its budget here, and CleanRL's published result."""

    env_id: str
    budget: int
    published: str
    """CleanRL's mean ± std with its script and budget (docs of ppo.py, ppo_continuous_action.py,
    ppo_atari.py; pr-424 runs), or what it does not publish."""
    args: tuple[str, ...] = ()
    baseline: bool = False
    """Whether bench/cleanrl_ppo.py (vector observations) runs it here too."""
    continuous: bool = False
    """Whether the baseline takes ppo_continuous_action.py's settings instead of ppo.py's."""
    cleanrl_env_id: str = ""
    """The id CleanRL's own script gets for this row ("": it does not run the row). Its pinned
    gymnasium 0.29.1 has the MuJoCo tasks at v4 only, so a v5 row runs v4 there: the same robot
    and reward, though not the same id, and the table says so."""

    @property
    def cleanrl_py(self) -> Path | None:
        """Which of CleanRL's own scripts runs the row (None: neither does): ppo.py takes
        discrete actions, ppo_continuous_action.py continuous ones."""
        if not self.cleanrl_env_id:
            return None
        return cleanrl_script.PPO_CONTINUOUS if self.continuous else cleanrl_script.PPO


TASKS = (
    Task(
        "CartPole-v1",
        100_000,
        "490.04 ± 6.12 (ppo.py, 500k)",
        baseline=True,
        cleanrl_env_id="CartPole-v1",
    ),
    Task(
        "Acrobot-v1",
        100_000,
        "-86.36 ± 1.32 (ppo.py, 500k)",
        baseline=True,
        cleanrl_env_id="Acrobot-v1",
    ),
    Task(
        "gym:HalfCheetah-v5",
        200_000,
        "1442.64 ± 46.03 (v4, ppo_continuous_action.py, 1M)",
        baseline=True,
        continuous=True,
        cleanrl_env_id="HalfCheetah-v4",
    ),
    Task(
        "gym:Hopper-v5",
        200_000,
        "2382.86 ± 271.74 (v4, ppo_continuous_action.py, 1M)",
        baseline=True,
        continuous=True,
        cleanrl_env_id="Hopper-v4",
    ),
    Task("gym:MinAtar/Breakout-v1", 200_000, "not published for PPO"),
    Task("gym:MiniGrid-DoorKey-5x5-v0", 100_000, "not published"),
    Task(
        "gym:ALE/Breakout-v5",
        100_000,
        "414.66 ± 28.09 (NoFrameskip-v4, ppo_atari.py, 10M)",
        args=("--wrapper", "atari"),
    ),
)
QUICK = (
    Task(
        "CartPole-v1",
        4_096,
        "490.04 ± 6.12 (ppo.py, 500k)",
        baseline=True,
        cleanrl_env_id="CartPole-v1",
    ),
)


@dataclass(frozen=True)
class Cell:
    """The seeds' final returns and wall seconds for one trainer on one task."""

    returns: tuple[float, ...]
    wall_s: tuple[float, ...]
    failed: str = ""
    """Why the trainer did not finish its seeds (one line), or "" if it did."""

    def mean_std(self) -> str:
        if self.failed:
            return f"failed: {self.failed}"
        finite = [r for r in self.returns if math.isfinite(r)]
        if not finite:
            return "no episode ended"
        spread = statistics.stdev(finite) if len(finite) > 1 else 0.0
        return f"{statistics.fmean(finite):.2f} ± {spread:.2f}"

    @property
    def mean(self) -> float:
        finite = [r for r in self.returns if math.isfinite(r)]
        return statistics.fmean(finite) if finite else math.nan


def train_shoal(task: Task, seed: int, root: Path) -> tuple[float, float]:
    """Final training return and wall seconds of one `shoal train` run."""
    argv = [
        sys.executable, "-m", "shoal", "train", task.env_id, *task.args, "--seed", str(seed),
        "--max-env-steps", str(task.budget), "--target-return", "1e12", "--time-limit", "7200",
        "--no-eval", "--quiet", "--json", "--run-dir", str(root / f"{_slug(task)}-{seed}"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode not in (0, 1) or not lines:
        raise RuntimeError(f"shoal train {task.env_id} failed: {done.stderr[-2000:]}")
    summary = json.loads(lines[-1])
    final = summary.get("final_return")
    return (math.nan if final is None else float(final)), float(summary["wall_s"])


def train_baseline(task: Task, seed: int) -> tuple[float, float]:
    started = time.perf_counter()
    result = cleanrl_ppo.run(
        seed=seed,
        time_limit_s=7200.0,
        target=math.inf,
        max_env_steps=task.budget,
        args=baseline_args(task),
        on_iteration=_progress(task, seed),
    )
    curve = result["curve"]
    final = float(curve[-1][2]) if curve else math.nan
    return final, time.perf_counter() - started


def baseline_args(task: Task) -> cleanrl_ppo.Args:
    """CleanRL's settings for the task's kind of action, with the task's budget."""
    gym_id = task.env_id.removeprefix("gym:")
    if task.continuous:
        return cleanrl_ppo.Args.continuous(gym_id, task.budget)
    return cleanrl_ppo.Args(env_id=gym_id, total_timesteps=task.budget)


def train_cleanrl(
    task: Task, script: Path, seed: int, checkout: cleanrl_script.Checkout, root: Path
) -> tuple[float, float]:
    """Final training return and wall seconds of one run of CleanRL's own `script` on the
    task's `cleanrl_env_id`."""
    episodes, wall = cleanrl_script.train(
        checkout, script, task.cleanrl_env_id, task.budget, seed, cwd=root, time_limit_s=7200.0
    )
    print(
        f"CleanRL {script.name} {task.cleanrl_env_id} seed {seed}: {episodes.count:,} episodes "
        f"to step {episodes.last_step:,}, return {episodes.final_return:.2f}, {wall:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return episodes.final_return, wall


def _progress(task: Task, seed: int) -> Callable[[cleanrl_ppo.Point], None]:
    """Prints the loop's return to stderr at each tenth of the budget: a long run shows how far
    it got if it has to be stopped."""
    shown = [0]

    def show(point: cleanrl_ppo.Point) -> None:
        wall, steps, mean20 = point
        tenth = 10 * steps // task.budget
        if tenth > shown[0]:
            shown[0] = tenth
            print(
                f"{CLEANRL} {task.env_id} seed {seed}: {steps:,} steps, return {mean20:.2f}, "
                f"{wall:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    return show


class Result(NamedTuple):
    """One row's cells: shoal's, the CleanRL-style loop's and CleanRL's own script's (None: not
    run)."""

    task: Task
    ours: Cell | None
    base: Cell | None
    cleanrl: Cell | None = None


TRAINERS = ("both", "shoal", "baseline", "cleanrl")


def measure(
    tasks: tuple[Task, ...],
    seeds: tuple[int, ...],
    trainer: str = "both",
    cleanrl: cleanrl_script.Checkout | None = None,
) -> Iterator[Result]:
    """Each task's cells as soon as its runs are done (a long table shows its rows as it goes);
    `trainer` runs one side only ("both": every side there is), and CleanRL's own scripts run
    only with a `cleanrl` checkout, on the rows they can run."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-learning-") as tmp:
        for task in tasks:
            ours = (
                _cell([train_shoal(task, seed, Path(tmp)) for seed in seeds])
                if trainer in ("both", "shoal")
                else None
            )
            base = (
                _cell([train_baseline(task, seed) for seed in seeds])
                if task.baseline and trainer in ("both", "baseline")
                else None
            )
            script = task.cleanrl_py
            theirs = (
                _cleanrl_cell(task, script, seeds, cleanrl, Path(tmp))
                if cleanrl is not None and script is not None and trainer in ("both", "cleanrl")
                else None
            )
            yield Result(task, ours, base, theirs)


def run(quick: bool) -> list[Row]:
    """`shoal bench learning`: the mean final return per task (quick: one tiny CartPole run)."""
    tasks, seeds = (QUICK, (0,)) if quick else (TASKS, SEEDS)
    return [
        Row(
            f"{task.env_id} return at {task.budget:,} steps",
            "return",
            math.nan if ours is None else ours.mean,
            None if base is None else base.mean,
            CLEANRL if base is not None else f"CleanRL published: {task.published}",
            higher_is_better=True,
        )
        for task, ours, base, _ in measure(tasks, seeds)
    ]


HEADER = (
    "| environment | steps | shoal return | shoal wall s | CleanRL-style loop here | "
    "its wall s | CleanRL's own script here | its wall s | CleanRL published |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def markdown_row(result: Result) -> str:
    task, ours, base, theirs = result
    return (
        f"| {task.env_id} {' '.join(task.args)} | {task.budget:,} | {_columns(ours)} | "
        f"{_columns(base)} | {_cleanrl_columns(task, theirs)} | {task.published} |"
    )


def _cleanrl_columns(task: Task, cell: Cell | None) -> str:
    """CleanRL's columns, its return naming the env id it ran where that is not the row's (the
    MuJoCo rows' v4 beside shoal's v5), so the table never passes one off as the other."""
    columns = _columns(cell)
    if cell is None or cell.failed or task.cleanrl_env_id == task.env_id.removeprefix("gym:"):
        return columns
    ret, wall = columns.split(" | ")
    return f"{ret} ({task.cleanrl_env_id}) | {wall}"


def _columns(cell: Cell | None) -> str:
    """A trainer's return and wall-time columns ("—" for a side that did not run)."""
    return "— | —" if cell is None else f"{cell.mean_std()} | {_wall(cell)}"


def _cell(runs: list[tuple[float, float]]) -> Cell:
    return Cell(tuple(r for r, _ in runs), tuple(w for _, w in runs))


def _cleanrl_cell(
    task: Task,
    script: Path,
    seeds: tuple[int, ...],
    checkout: cleanrl_script.Checkout,
    root: Path,
) -> Cell:
    """CleanRL's cell, or, if one of its runs fails, a cell that says why (the whole error goes
    to stderr): the other trainers' cells in the row and the rows after it still count."""
    runs: list[tuple[float, float]] = []
    try:
        for seed in seeds:
            runs.append(train_cleanrl(task, script, seed, checkout, root))
    except cleanrl_script.CleanRLError as err:
        print(f"CleanRL {script.name} {task.env_id}: {err}", file=sys.stderr, flush=True)
        lines = str(err).strip().splitlines() or ["no reason given"]
        why = lines[-1][:120].replace("|", "\\|")
        return Cell((), (), failed=f"seed {seeds[len(runs)]}: {why}")
    return _cell(runs)


def _wall(cell: Cell) -> str:
    return f"{statistics.fmean(cell.wall_s):.0f}" if cell.wall_s else "—"


def _slug(task: Task) -> str:
    return task.env_id.replace(":", "-").replace("/", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per task (0, 1, …)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed's number")
    parser.add_argument("--only", nargs="*", help="env ids to run (default: every task)")
    parser.add_argument("--steps", type=int, help="step budget for every task (default: its own)")
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="both",
        help="which side to run (both: shoal, the CleanRL-style loop and, given --cleanrl, CleanRL)",
    )
    parser.add_argument(
        "--cleanrl",
        type=Path,
        metavar="DIR",
        help="a checkout of CleanRL: its cleanrl/ppo.py runs the classic-control rows too and "
        "cleanrl/ppo_continuous_action.py the MuJoCo rows, at v4 (--env-id, --total-timesteps, "
        "--seed, --no-cuda), in a scratch folder",
    )
    parser.add_argument(
        "--cleanrl-python",
        default=sys.executable,
        metavar="PY",
        help="the interpreter with CleanRL's dependencies, gymnasium 0.29 among them "
        "(default: this one)",
    )
    args = parser.parse_args()
    tasks = tuple(t for t in TASKS if not args.only or t.env_id in args.only)
    checkout = None
    if args.cleanrl is not None:
        checkout = cleanrl_script.Checkout(args.cleanrl, args.cleanrl_python)
        missing = _missing_scripts(checkout, tasks)
        if missing:
            parser.error(f"--cleanrl {args.cleanrl}: no {', '.join(missing)} there")
    elif args.trainer == "cleanrl":
        parser.error("--trainer cleanrl needs --cleanrl DIR, a checkout of CleanRL")
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps {args.steps} is invalid: give a positive step budget")
        tasks = tuple(dataclasses.replace(t, budget=args.steps) for t in tasks)
    seeds = tuple(range(args.first_seed, args.first_seed + args.seeds))
    print(HEADER, flush=True)
    failed = False
    for result in measure(tasks, seeds, args.trainer, checkout):
        print(markdown_row(result), flush=True)
        failed = failed or bool(result.cleanrl and result.cleanrl.failed)
    if failed:
        sys.exit("CleanRL's own script failed: its error is above, its cell says why")


def _missing_scripts(checkout: cleanrl_script.Checkout, tasks: tuple[Task, ...]) -> list[str]:
    """The scripts the chosen rows need that the checkout lacks: checked before anything runs,
    so a wrong folder fails in a second, not after hours of shoal's runs."""
    needed = sorted({t.cleanrl_py for t in tasks if t.cleanrl_py is not None})
    return [str(script) for script in needed if not checkout.path(script).is_file()]


if __name__ == "__main__":
    main()
