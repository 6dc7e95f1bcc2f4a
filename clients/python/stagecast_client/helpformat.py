"""The help formatter of the stagecast commands: the client verbs' (``stagecast-client generate``) and the
services' (``stagecast.flags`` re-exports it), so every ``--help`` prints defaults the same way."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``ArgumentDefaultsHelpFormatter`` that prints a default once: not when the help already says ``default:``,
    and not for None or an empty list (a value the service works out) or a switch (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if not shows_default(action) else super()._get_help_string(action) or text


def shows_default(action: argparse.Action) -> bool:
    """Whether ``HelpFormatter`` appends ``(default: X)`` to ``action``'s help."""
    switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    return not (
        switch
        or not action.option_strings
        or action.default in (None, [], ())
        or action.default is argparse.SUPPRESS
        or "default:" in (action.help or "")
    )
