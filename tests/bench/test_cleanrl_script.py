"""CleanRL's own ppo.py and ppo_continuous_action.py as the learning bench's third trainer: the
argv they get, which row runs which with which env id, the bounded parser of their stdout (pinned
messages, and hypothesis over hostile bytes), and the subprocess path run with fake scripts under
this interpreter — no CleanRL checkout or venv needed."""

from __future__ import annotations

import math
import statistics
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bench import cleanrl_script, learning
from shoal.bench.cleanrl_script import (
    PPO,
    PPO_CONTINUOUS,
    Checkout,
    CleanRLError,
    Episodes,
    MalformedOutput,
    parse_episodes,
    ppo_argv,
)
from shoal.bench.learning import HEADER, TASKS, Cell, Result, Task, markdown_row


def episode(step: int, value: float) -> bytes:
    return f"global_step={step}, episodic_return=[{value!r}]\n".encode()


# ---- the parser ------------------------------------------------------------------------------


def test_the_final_return_is_the_mean_of_the_last_20_episodes_and_other_lines_are_skipped():
    out = [episode(4 * i, float(i)) for i in range(1, 31)]
    out.insert(10, b"SPS: 5073\n")
    out.append(b"SPS: 4900\n")
    got = parse_episodes(out)
    assert got == Episodes(30, 120, tuple(float(i) for i in range(11, 31)))
    assert got.final_return == statistics.fmean(range(11, 31))


def test_numpys_forms_crlf_and_a_last_line_without_newline_parse():
    lines = [
        b"global_step=48, episodic_return=[12.]\r\n",
        b"global_step=48, episodic_return=[ -500.]\n",
        b"global_step=60, episodic_return=[1.e+03]\n",
        b"global_step=61, episodic_return=-7.25",
    ]
    assert parse_episodes(lines) == Episodes(4, 61, (12.0, -500.0, 1000.0, -7.25))


def test_no_episode_is_a_nan_return_not_an_error():
    got = parse_episodes([b"SPS: 10\n", b""])
    assert (got.count, got.last_step, got.last) == (0, 0, ())
    assert math.isnan(got.final_return)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"global_step=12, episodic_return=[nan]", "line 2 is not an episode's return: "),
        (b"global_step=12, episodic_return=[1.0", "line 2 is not an episode's return: "),
        (b"global_step=12, episodic_return=1.0]", "line 2 is not an episode's return: "),
        (b"global_step=-4, episodic_return=[1.0]", "line 2 is not an episode's return: "),
        (b"global_step=12, episodic_return=[1, 2]", "line 2 is not an episode's return: "),
        (b"global_step=\xff\xfe, episodic_return=[1]", "line 2 is not an episode's return: "),
        (b"global_step=12, episodic_return=[1e9999]", "line 2 has a return out of range: "),
        (b"global_step=3, episodic_return=[1.0]", "line 2 goes back from global_step=8: "),
    ],
)
def test_a_malformed_episode_line_is_rejected_by_number_and_quoted(line, message):
    with pytest.raises(MalformedOutput) as caught:
        parse_episodes([episode(8, 1.0), line + b"\n"])
    assert str(caught.value) == message + repr(line)


def test_a_quoted_line_is_cut_at_80_bytes():
    line = b"global_step=1, episodic_return=[" + b"9" * 200 + b"x]"
    with pytest.raises(MalformedOutput, match=r"^line 1 is not an episode's return: b'glob.*'…$"):
        parse_episodes([line])


def test_a_line_over_the_cap_and_too_many_lines_are_rejected(monkeypatch):
    long = b"SPS: " + b"1" * cleanrl_script.MAX_LINE
    with pytest.raises(MalformedOutput, match=r"^line 2 is longer than 4096 bytes$"):
        parse_episodes([b"SPS: 1\n", long])
    parse_episodes([long[: cleanrl_script.MAX_LINE] + b"\r\n"])  # at the cap: fine
    monkeypatch.setattr(cleanrl_script, "MAX_LINES", 5)
    parse_episodes([b"SPS: 1\n"] * 5)
    with pytest.raises(MalformedOutput, match=r"^more than 5 lines of output$"):
        parse_episodes(b"SPS: 1\n" for _ in range(10**9))  # stops at the cap, not at the end


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=40))
def test_arbitrary_bytes_parse_or_are_rejected_with_malformed_output_only(lines):
    try:
        got = parse_episodes(lines)
    except MalformedOutput:
        return
    assert got.count >= len(got.last)
    assert len(got.last) <= cleanrl_script.WINDOW
    assert all(math.isfinite(r) for r in got.last)


hostile_text = st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=120).map(
    str.encode
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), hostile_text), max_size=40))
def test_hostile_text_after_the_episode_prefix_never_escapes_as_another_exception(items):
    lines = [(b"global_step=" if prefixed else b"") + text for prefixed, text in items]
    try:
        got = parse_episodes(lines)
    except MalformedOutput:
        return
    assert got.count <= sum(prefixed for prefixed, _ in items)


steps_and_returns = st.lists(
    st.tuples(st.integers(0, 10**6), st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)),
    max_size=60,
)
junk = st.lists(
    st.binary(max_size=80).filter(lambda b: not b.startswith(b"global_step=") and b"\n" not in b),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(steps_and_returns, junk, st.randoms(use_true_random=False))
def test_well_formed_episodes_among_other_lines_round_trip(episodes, other, rnd):
    episodes = sorted(episodes, key=lambda e: e[0])
    lines = [episode(step, value) for step, value in episodes]
    for line in other:  # other lines anywhere, episodes kept in order
        lines.insert(rnd.randint(0, len(lines)), line + b"\n")
    got = parse_episodes(lines)
    assert got.count == len(episodes)
    assert got.last_step == (episodes[-1][0] if episodes else 0)
    assert got.last == tuple(value for _, value in episodes[-cleanrl_script.WINDOW :])


# ---- the argv and the subprocess path --------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "env_id", "path"),
    [
        (PPO, "Acrobot-v1", "/src/cleanrl-checkout/cleanrl/ppo.py"),
        (PPO_CONTINUOUS, "Hopper-v4", "/src/cleanrl-checkout/cleanrl/ppo_continuous_action.py"),
    ],
)
def test_each_script_gets_the_env_the_budget_the_seed_and_no_cuda(script, env_id, path):
    checkout = Checkout(Path("/src/cleanrl-checkout"), "/venv/bin/python")
    assert ppo_argv(checkout, script, env_id, 100_000, 2) == [
        "/venv/bin/python", path, "--env-id", env_id,
        "--total-timesteps", "100000", "--seed", "2", "--no-cuda",
    ]  # fmt: skip


def fake_checkout(root: Path, body: str, scripts: tuple[Path, ...] = (PPO,)) -> Checkout:
    """A folder whose `scripts` each run `body` under this interpreter."""
    (root / "cleanrl").mkdir(parents=True)
    for script in scripts:
        (root / script).write_text(
            "import json, sys, time\n" + textwrap.dedent(body), encoding="utf-8"
        )
    return Checkout(root, sys.executable)


PRINTS_EPISODES = """
    json.dump(sys.argv[1:], open("argv.json", "w"))  # in the scratch folder, not the checkout
    seed = int(sys.argv[sys.argv.index("--seed") + 1])
    bonus = 100 if sys.argv[0].endswith("ppo_continuous_action.py") else 0
    for i in range(1, 26):
        print(f"global_step={8 * i}, episodic_return=[{float(i + seed + bonus)}]")
    print("SPS: 1234")
    print("a warning", file=sys.stderr)
"""


def test_a_fake_ppo_py_runs_through_the_real_subprocess_path(tmp_path):
    checkout = fake_checkout(tmp_path / "src", PRINTS_EPISODES)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    got, wall = cleanrl_script.train(
        checkout, PPO, "CartPole-v1", 200, 3, cwd=scratch, time_limit_s=60.0
    )
    assert got == Episodes(25, 200, tuple(float(i + 3) for i in range(6, 26)))
    assert 0 < wall < 60
    assert (scratch / "argv.json").read_text() == (
        '["--env-id", "CartPole-v1", "--total-timesteps", "200", "--seed", "3", "--no-cuda"]'
    )
    assert not (checkout.root / "argv.json").exists()


def test_a_failing_run_quotes_the_tail_of_its_stderr(tmp_path):
    checkout = fake_checkout(
        tmp_path, 'sys.stderr.write("x" * 5000 + "final_info KeyError\\n"); sys.exit(3)'
    )
    with pytest.raises(CleanRLError) as caught:
        cleanrl_script.train(checkout, PPO, "CartPole-v1", 100, 0, cwd=tmp_path, time_limit_s=60.0)
    message = str(caught.value)
    assert message.startswith("CartPole-v1 seed 0 exited 3: xxx")
    assert message.endswith("final_info KeyError")
    assert len(message) < cleanrl_script.STDERR_TAIL + 100


@pytest.mark.parametrize(
    "body",
    [
        'print("global_step=8, episodic_return=[oops]", flush=True); time.sleep(60)',
        'sys.stdout.write("SPS: " + "9" * 10**6); sys.stdout.flush(); time.sleep(60)',
    ],
)
def test_malformed_output_kills_the_run_at_once(tmp_path, body):
    checkout = fake_checkout(tmp_path, body)
    started = time.monotonic()
    with pytest.raises(MalformedOutput, match=r"^line 1 is "):
        cleanrl_script.train(checkout, PPO, "CartPole-v1", 100, 0, cwd=tmp_path, time_limit_s=60.0)
    assert time.monotonic() - started < 30


def test_a_run_past_its_time_limit_is_killed(tmp_path):
    checkout = fake_checkout(tmp_path, "time.sleep(60)")
    with pytest.raises(CleanRLError, match=r"^Acrobot-v1 seed 1 ran past 1 s$"):
        cleanrl_script.train(checkout, PPO, "Acrobot-v1", 100, 1, cwd=tmp_path, time_limit_s=1.0)


def test_a_missing_script_or_interpreter_is_a_cleanrl_error(tmp_path):
    with pytest.raises(CleanRLError, match=r"^no cleanrl/ppo.py under "):
        cleanrl_script.train(
            Checkout(tmp_path, sys.executable), PPO, "CartPole-v1", 100, 0, cwd=tmp_path,
            time_limit_s=60.0,
        )  # fmt: skip
    checkout = fake_checkout(tmp_path, "pass")
    with pytest.raises(CleanRLError, match=r"^no cleanrl/ppo_continuous_action.py under "):
        cleanrl_script.train(
            checkout, PPO_CONTINUOUS, "Hopper-v4", 100, 0, cwd=tmp_path, time_limit_s=60.0
        )
    with pytest.raises(CleanRLError, match=r"^cannot start /nonexistent/python: "):
        cleanrl_script.train(
            Checkout(checkout.root, "/nonexistent/python"), PPO, "CartPole-v1", 100, 0,
            cwd=tmp_path, time_limit_s=60.0,
        )  # fmt: skip


# ---- the learning bench's third column -------------------------------------------------------


def test_each_row_picks_its_cleanrl_script_and_the_env_id_cleanrls_gymnasium_has():
    assert {t.env_id: (t.cleanrl_py, t.cleanrl_env_id) for t in TASKS} == {
        "CartPole-v1": (PPO, "CartPole-v1"),
        "Acrobot-v1": (PPO, "Acrobot-v1"),
        # gymnasium 0.29.1, CleanRL's pin, has the MuJoCo tasks at v4 only
        "gym:HalfCheetah-v5": (PPO_CONTINUOUS, "HalfCheetah-v4"),
        "gym:Hopper-v5": (PPO_CONTINUOUS, "Hopper-v4"),
        "gym:MinAtar/Breakout-v1": (None, ""),
        "gym:MiniGrid-DoorKey-5x5-v0": (None, ""),
        "gym:ALE/Breakout-v5": (None, ""),
    }
    assert all(t.baseline for t in TASKS if t.cleanrl_py is not None)
    assert all(t.continuous == (t.cleanrl_py == PPO_CONTINUOUS) for t in TASKS if t.cleanrl_py)


def test_the_table_has_a_column_pair_for_cleanrl_itself():
    task = Task("CartPole-v1", 1000, "490.04 ± 6.12 (ppo.py, 500k)", cleanrl_env_id="CartPole-v1")
    row = markdown_row(Result(task, None, None, Cell((100.0, 300.0), (4.0, 6.0))))
    assert row == (
        "| CartPole-v1  | 1,000 | — | — | — | — | 200.00 ± 141.42 | 5 | "
        "490.04 ± 6.12 (ppo.py, 500k) |"
    )
    assert HEADER.splitlines()[0].count("|") == row.count("|") == 10
    assert "| CleanRL's own script here | its wall s | CleanRL published |" in HEADER


def test_cleanrls_return_names_its_v4_env_beside_shoals_v5():
    task = Task("gym:Hopper-v5", 1000, "2382.86", continuous=True, cleanrl_env_id="Hopper-v4")
    row = markdown_row(Result(task, None, None, Cell((100.0,), (4.0,))))
    assert (
        row
        == "| gym:Hopper-v5  | 1,000 | — | — | — | — | 100.00 ± 0.00 (Hopper-v4) | 4 | 2382.86 |"
    )
    failed = markdown_row(Result(task, None, None, Cell((), (), failed="seed 0: boom")))
    assert "| failed: seed 0: boom | — |" in failed


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int | str | None, str, str]:
    monkeypatch.setattr(sys, "argv", ["learning", *argv])
    code: int | str | None = 0
    try:
        learning.main()
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def test_trainer_cleanrl_runs_the_fake_scripts_for_each_seed_and_nothing_else(
    tmp_path, monkeypatch, capsys
):
    checkout = fake_checkout(tmp_path, PRINTS_EPISODES, (PPO, PPO_CONTINUOUS))
    code, out, err = run_main(
        monkeypatch, capsys, "--trainer", "cleanrl", "--cleanrl", str(checkout.root),
        "--only", "CartPole-v1", "gym:Hopper-v5", "gym:MinAtar/Breakout-v1", "--seeds", "2",
        "--steps", "200",
    )  # fmt: skip
    assert code == 0, err
    *_, cartpole, hopper, minatar = out.splitlines()  # after the header and its rule
    # seeds 0 and 1: the last 20 returns are 6..25 plus the seed, means 15.5 and 16.5, and the
    # fake ppo_continuous_action.py adds 100
    assert cartpole.startswith("| CartPole-v1  | 200 | — | — | — | — | 16.00 ± 0.71 | ")
    assert hopper.startswith(
        "| gym:Hopper-v5  | 200 | — | — | — | — | 116.00 ± 0.71 (Hopper-v4) | "
    )
    assert minatar.startswith("| gym:MinAtar/Breakout-v1  | 200 | — | — | — | — | — | — | ")
    assert "CleanRL ppo.py CartPole-v1 seed 1: 25 episodes to step 200, return 16.50" in err
    assert (
        "CleanRL ppo_continuous_action.py Hopper-v4 seed 1: 25 episodes to step 200, "
        "return 116.50" in err
    )


def test_the_cleanrl_flags_are_checked_before_anything_runs(tmp_path, monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "--trainer", "cleanrl")
    assert code == 2
    assert "--trainer cleanrl needs --cleanrl DIR, a checkout of CleanRL" in err
    code, _, err = run_main(monkeypatch, capsys, "--cleanrl", str(tmp_path))
    assert code == 2
    assert f"--cleanrl {tmp_path}: no cleanrl/ppo.py, cleanrl/ppo_continuous_action.py there" in err


def test_the_checkout_needs_only_the_scripts_of_the_chosen_rows(tmp_path, monkeypatch, capsys):
    checkout = fake_checkout(tmp_path, PRINTS_EPISODES)  # ppo.py only
    cleanrl = (
        "--trainer", "cleanrl", "--cleanrl", str(checkout.root), "--steps", "200", "--seeds", "1",
    )  # fmt: skip
    code, _, err = run_main(monkeypatch, capsys, *cleanrl, "--only", "gym:HalfCheetah-v5")
    assert code == 2
    assert f"--cleanrl {tmp_path}: no cleanrl/ppo_continuous_action.py there" in err
    code, out, err = run_main(monkeypatch, capsys, *cleanrl, "--only", "Acrobot-v1")
    assert code == 0, err
    assert out.splitlines()[-1].startswith("| Acrobot-v1  | 200 | — | — | — | — | 15.50 ± 0.00 | ")


FAILS_ON_SEED_1 = """
    if sys.argv[sys.argv.index("--seed") + 1] == "1":
        for i in range(200):
            print(f'  File "gymnasium/envs/classic_control/acrobot.py", line {i}', file=sys.stderr)
        sys.exit("AttributeError: `np.float_` was removed | use np.float64")
    print("global_step=8, episodic_return=[-500.]")
"""


def test_a_failed_cleanrl_run_fails_its_cell_not_the_table(tmp_path, monkeypatch, capsys):
    checkout = fake_checkout(tmp_path, FAILS_ON_SEED_1)
    code, out, err = run_main(
        monkeypatch, capsys, "--trainer", "cleanrl", "--cleanrl", str(checkout.root),
        "--only", "CartPole-v1", "Acrobot-v1", "--seeds", "2", "--steps", "100",
    )  # fmt: skip
    assert code == "CleanRL's own script failed: its error is above, its cell says why"
    rows = out.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| CartPole-v1 ", "| Acrobot-v1 "]
    failed = "failed: seed 1: AttributeError: `np.float_` was removed \\| use np.float64 | — |"
    assert all(f"| — | — | — | — | {failed} " in row for row in rows)
    # the whole error, from a line's start, on stderr
    assert 'CleanRL ppo.py Acrobot-v1: Acrobot-v1 seed 1 exited 1: File "gymnasium/' in err
    assert "line 199\nAttributeError: `np.float_` was removed | use np.float64\n" in err
    assert "CleanRL ppo.py CartPole-v1 seed 0: 1 episodes to step 8, return -500.00" in err
