"""The argument parser of every ``cbatch`` command: each flag's default shown in ``--help``,
and a suggestion for a mistyped flag, command or choice (argparse's own ``suggest_on_error``
needs Python 3.14)."""

from __future__ import annotations

import argparse
import difflib
import re

_INVALID_CHOICE = re.compile(
    r"invalid choice: '?(?P<given>[^',]*)'?.*\(choose from (?P<choices>.*)\)")


def closest(word: str, candidates) -> str | None:
    """The candidate nearest ``word``, if one is near enough to be what was meant."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to each flag's help, unless the help already says what its
    default means (``auto``, ``None``) in words."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class CLIParser(argparse.ArgumentParser):
    """An ArgumentParser with :class:`HelpFormatter` and "did you mean" suggestions; the
    parsers of its subcommands are CLIParsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = [c.strip().strip("'\"") for c in match["choices"].split(",")]
            guess = closest(match["given"], choices)
            if guess:
                message += f"; did you mean {guess!r}?"
        super().error(message)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is reported by the subcommand's parser (its
        usage line, its flags), with the nearest flag it has."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(namespace) or self
            flags = [s for a in parser._actions for s in a.option_strings]
            hints = []
            for extra in extras:
                flag = extra.split("=", 1)[0]
                guess = closest(flag, flags) if flag.startswith("-") else None
                if guess:
                    hints.append(f"{flag}: did you mean {guess}?")
            parser.error("unrecognized arguments: " + " ".join(extras)
                         + ("; " + "; ".join(hints) if hints else ""))
        return namespace

    def _command_parser(self, namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(namespace, action.dest, None))
        return None
