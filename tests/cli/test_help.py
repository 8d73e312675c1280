"""`ftc <command> --help` documents every option of every command, with its default."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from cli.main import build_parser, main


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under `ftc`, nested ones (`ftc jobs ls`) included, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


COMMANDS = [path for path, _ in commands(build_parser())]
PARSERS = dict(commands(build_parser()))


def test_every_sub_command_is_reached():
    assert ("compress",) in COMMANDS and ("jobs", "ls") in COMMANDS and ("sweep", "create") in COMMANDS


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "ftc")
def test_help_shows_every_option_with_its_help_and_default(path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*path, "--help"])
    assert exited.value.code == 0
    shown = flat(capsys.readouterr().out)
    parser = PARSERS[path]
    command = " ".join(("ftc", *path))
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{command}: {name} has no help text"
        entry = flat(parser._get_formatter()._format_action(action))  # this option's lines of --help
        assert entry in shown, f"{command} --help does not show {name}"
        assert flat(action.help.split("%(")[0])[:30] in entry, f"{command}: {name} shows no help: {entry!r}"
        if action.option_strings and action.default not in (None, argparse.SUPPRESS):
            assert f"(default: {action.default}" in entry, f"{command}: {name} hides its default: {entry!r}"
