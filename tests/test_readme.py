"""The README tells the truth about the tree and the commands: its layout block lists exactly the
modules and folders that exist, and every ``tuner ...`` line it shows names a real command whose
``--help`` lists each flag the line uses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks() -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S)


def layout_paths() -> set[str]:
    """Paths named by the layout block (the one that starts with ``tuner/``)."""
    block = next(b for b in code_blocks() if b.startswith("tuner/\n"))
    paths, stack = set(), []
    for line in block.splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [name]
        paths.add("".join(stack).rstrip("/"))
    return paths


def tree_paths() -> set[str]:
    """Every module of tuner/ and server/, and every folder holding one (a package's own
    ``__init__.py`` / ``__main__.py`` are its folder's line; tuner's ``__init__.py`` is the
    public face and has a line of its own)."""
    found = set()
    for top in ("tuner", "server"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            found.update(str(parent) for parent in rel.parents if parent != Path("."))
            if path.name not in ("__init__.py", "__main__.py") or rel == Path("tuner/__init__.py"):
                found.add(str(rel))
    return found


def test_the_layout_block_lists_exactly_the_tree() -> None:
    listed, actual = layout_paths(), tree_paths()
    assert sorted(actual - listed) == [], "in the tree, missing from README's layout"
    assert sorted(listed - actual) == [], "in README's layout, not in the tree"


def shown_commands() -> list[list[str]]:
    """Every ``tuner ...`` line of the README's shell blocks, as words (comments and
    continuation lines joined, placeholders kept)."""
    lines = []
    for block in code_blocks():
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            for part in re.split(r"&&|;", line):
                part = part.strip()
                if part.startswith("tuner ") and "(" not in part:
                    lines.append(shlex.split(part)[1:])
    return lines


COMMANDS = shown_commands()


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w)[:60] for w in COMMANDS])
def test_every_command_the_readme_shows_exists_with_its_flags(words: list[str]) -> None:
    path = []
    for word in words:
        if word.startswith("-"):
            break
        path.append(word)
        probe = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        if probe.exit_code != 0:  # an argument, not a subcommand
            path.pop()
            break
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in result.output, f"`tuner {' '.join(path)}` has no {flag}"
