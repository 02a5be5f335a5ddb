"""MkDocs hook: the reference's generated parts, so that they follow the code.

``<!-- du-launch options -->`` in a page becomes the table of every option of du-launch's parser
(``distributed_utils.launch.parse_args``), with its metavar and help text (which gives the default).
"""

import argparse
from unittest import mock

OPTIONS_MARK = "<!-- du-launch options -->"


class _Captured(Exception):
    pass


def launch_parser() -> argparse.ArgumentParser:
    """The parser ``launch.parse_args`` builds (caught as it starts parsing: nothing runs)."""
    from distributed_utils import launch

    parsers = []

    def capture(parser, *args, **kwargs):
        parsers.append(parser)
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            launch.parse_args([])
        except _Captured:
            pass
    return parsers[0]


def options_table() -> str:
    """A markdown table: one row per option of du-launch, in the parser's order."""
    rows = ["| option | what it does |", "| --- | --- |"]
    for action in launch_parser()._actions:
        if not action.option_strings and action.dest != "command":
            continue
        metavar = action.metavar or (action.dest.upper() if action.nargs != 0 else "")
        if action.choices:
            metavar = "|".join(action.choices)
        names = ", ".join(action.option_strings)
        usage = " ".join(filter(None, [names, metavar])) if names else "COMMAND..."
        rows.append(f"| `{usage}` | {action.help or ''} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    if OPTIONS_MARK in markdown:
        markdown = markdown.replace(OPTIONS_MARK, options_table())
    return markdown
