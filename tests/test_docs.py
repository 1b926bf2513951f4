"""The docs cannot drift: the config reference is regenerated from the classes, and every command
shown in the README and docs/ parses with colorl's own argument parser (nothing is run)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from colorl.cli import build_parser
from colorl.config_reference import DEFAULT_OUT, render, walk

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(?:bash|sh|console|shell|text)\n(.*?)```", re.S)
# placeholders in usage lines -> a value of the right kind
PLACEHOLDERS = {"N": "2", "X": "1.5", "T": "50", "OUT.png": "out.png"}


def test_config_reference_is_up_to_date():
    assert DEFAULT_OUT.read_text(encoding="utf-8") == render(), "run: python -m colorl.config_reference"


def test_every_config_key_is_in_the_reference():
    text = DEFAULT_OUT.read_text(encoding="utf-8")
    keys = [doc.key for doc in walk()]
    assert {"run.steps", "model.lora.r", "rollout.length_override.cap", "mode", "launch.nproc"} <= set(keys)
    missing = [key for key in keys if f"`{key}`" not in text]
    assert missing == []


def test_every_config_key_is_described():
    """A key added without a `Field(description=...)`, a NOTES entry or a comment fails here."""
    assert [doc.key for doc in walk() if not doc.description.strip()] == []


def _colorl_commands(text: str) -> list[str]:
    """Lines in code blocks (fenced, or indented by four spaces) that run colorl, joined across
    backslash continuations."""
    commands = []
    indented = "\n".join(line[4:] for line in text.splitlines() if line.startswith("    ") and "colorl " in line)
    for block in FENCE.findall(text) + [indented]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().lstrip("$ ")
            match = re.search(r"(?:^|\s|/)colorl (\w.*)$", line)
            if match and not line.startswith(("pip", "git", "cd ")):
                commands.append(match.group(1))
    return commands


def _as_argv(command: str) -> list[str]:
    """A usage line ([optional] parts, a|b choices, `...`) becomes one concrete command line."""
    command = command.replace("...", " ")
    command = re.sub(r"\[|\]", " ", command)
    argv = []
    for word in shlex.split(command):
        word = word.split("|", 1)[0] if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", word) else word
        argv.append(PLACEHOLDERS.get(word, word))
    return argv


def _all_commands() -> list[tuple[str, str]]:
    return [(path.name, command) for path in DOCS for command in _colorl_commands(path.read_text(encoding="utf-8"))]


def test_docs_show_commands_of_every_subcommand():
    shown = {command.split()[0] for _, command in _all_commands()}
    assert {"train", "export", "predict", "simulate", "plot"} <= shown


@pytest.mark.parametrize("where, command", _all_commands())
def test_every_command_shown_parses(where, command):
    try:
        build_parser().parse_args(_as_argv(command))
    except SystemExit as exc:  # --version and --help exit 0 after printing
        if exc.code:
            pytest.fail(f"{where}: `colorl {command}` does not parse (exit {exc.code})")


def test_the_trl_table_names_only_real_config_keys():
    """docs/trl.md maps TRL's GRPOConfig to colorl's keys: a key renamed or removed fails here."""
    keys = {doc.key for doc in walk()}
    rows = [line.split("|") for line in (ROOT / "docs" / "trl.md").read_text().splitlines() if line.startswith("| `")]
    named = {key for row in rows for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+|mode)`", row[2])}
    assert named and named <= keys, sorted(named - keys)
