"""A typo gets the closest command or flag: ``dduf pakc`` says "did you mean pack?", ``--exlude`` says
"did you mean --exclude?" (argparse only lists the choices, or calls the flag unrecognized)."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")
UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
TOP_LEVEL_FLAGS = {"-v", "-vv", "-vvv", "--verbose"}  # the top-level parser's, given after the command


def closest(word: str, choices: list[str]) -> str | None:
    """The choice nearest ``word`` by difflib's ratio (0.6 and up), or None."""
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of the subcommand parsers it has built (``--exclude``, ``-o``...)."""
    flags = [s for action in parser._actions for s in action.option_strings]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += [s for a in sub._actions for s in a.option_strings]
    return sorted(set(flags))


def hint(parser: argparse.ArgumentParser, message: str) -> str | None:
    """"did you mean X?" for an argparse error message about a mistyped choice or flag, else None."""
    match = INVALID_CHOICE.search(message)
    if match:
        choices = re.findall(r"'([^']*)'", match[2])
        guess = closest(match[1], choices)
        return f"did you mean {guess}?" if guess else None
    match = UNRECOGNIZED.search(message)
    if match:
        flags = option_strings(parser)
        for word in match[1].split():
            if word in TOP_LEVEL_FLAGS and " " in parser.prog:  # `dduf validate -v X`: argparse says no more
                command = parser.prog.split(" ", 1)[1]
                return f"{word} goes before the command: dduf {word} {command} ..."
            if word.startswith("-"):
                guess = closest(word.split("=", 1)[0], flags)
                if guess:
                    return f"did you mean {guess}?"
    return None


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command`` that ``parser`` built, or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors end with the closest command or flag, when one is close."""

    def error(self, message: str) -> NoReturn:
        found = hint(self, message)
        super().error(f"{message}; {found}" if found else message)
