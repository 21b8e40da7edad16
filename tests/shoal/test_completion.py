"""`shoal completion`: the tree read from argparse (property-based) and the generated script run
by a real bash (and zsh where installed) completing real command lines."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cli import build_parser
from shoal.commands.completion import command_tree, render_bash

pytestmark = pytest.mark.timeout(60)

NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=6)


@st.composite
def parsers(draw: st.DrawFn) -> tuple[argparse.ArgumentParser, dict[str, list[str]]]:
    """A parser with random verbs, each with random `--options`; returns it and its shape."""
    parser = argparse.ArgumentParser(prog="prog")
    verbs = parser.add_subparsers()
    shape = {}
    for verb in draw(st.lists(NAMES, unique=True, max_size=5)):
        sub = verbs.add_parser(verb)
        options = draw(st.lists(NAMES, unique=True, max_size=4))
        for opt in options:
            sub.add_argument(f"--{opt}", choices=["x", "y"])
        shape[verb] = [f"--{o}" for o in options]
    return parser, shape


@given(parsers())
@settings(max_examples=60, deadline=None)
def test_the_tree_has_every_verb_and_option_and_their_choices(
    built: tuple[argparse.ArgumentParser, dict[str, list[str]]],
) -> None:
    parser, shape = built
    tree = command_tree(parser)
    assert list(tree.children) == list(shape)
    for verb, options in shape.items():
        node = tree.children[verb]
        assert node.path == ("prog", verb)
        assert [o for o in node.options if o not in ("-h", "--help")] == options
        assert all(node.value_options[o] == ["x", "y"] for o in options)
    assert render_bash(tree).count("_prog()") == 1


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "shoal", "completion", "bash"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    path = tmp_path_factory.mktemp("completion") / "shoal.bash"
    path.write_text(proc.stdout)
    return path


def complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of `words` (the word being typed)."""
    array = " ".join(f"'{w}'" for w in ("shoal", *words))
    program = (
        f"source {script}; COMP_WORDS=({array}); COMP_CWORD={len(words)}; _shoal; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    out = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30, check=True
    )
    return [line for line in out.stdout.splitlines() if line]


def test_bash_completes_every_verb_from_an_empty_word(script: Path) -> None:
    verbs = set(command_tree(build_parser()).children)
    assert {"train", "chaos", "completion", "coordinator"} <= verbs
    assert verbs <= set(complete(script, ""))


def test_bash_completes_nested_verbs_positional_choices_and_options(script: Path) -> None:
    assert complete(script, "ch") == ["chaos"]
    assert {"run", "soak", "inject"} <= set(complete(script, "chaos", ""))
    assert complete(script, "completion", "") == ["bash", "zsh", "-h", "--help"]
    assert complete(script, "bench", "--q") == ["--quick"]
    assert "raft" in complete(script, "bench", "--json", "")


def test_an_option_with_a_free_value_leaves_bash_to_complete_file_names(script: Path) -> None:
    assert complete(script, "coordinator", "--token-file", "") == []
    assert complete(script, "up", "--run-dir", "") == []


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here")
def test_zsh_runs_the_same_function_through_bashcompinit() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shoal", "completion", "zsh"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    # bashcompinit calls the function in sh emulation; zsh itself filters by the typed prefix.
    probe = (
        "t() { emulate -L sh; setopt kshglob noshglob braceexpand; "
        'COMP_WORDS=(shoal chaos ""); COMP_CWORD=2; _shoal; printf "%s\\n" "${COMPREPLY[@]}"; }; t'
    )
    out = subprocess.run(
        ["zsh", "-f", "-c", proc.stdout + "\n" + probe],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert {"run", "soak", "inject"} <= set(out.stdout.split())


def test_an_unknown_shell_is_refused_with_the_valid_ones() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shoal", "completion", "fish"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "choose from 'bash', 'zsh'" in proc.stderr
