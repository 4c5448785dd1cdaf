"""Settings from the command line: a settings class as an argparse parser with tokenq's flag
names, help and environment paragraph; a bad value is one :class:`UsageError` (exit 2)."""

from __future__ import annotations

import argparse
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

S = TypeVar("S")


class UsageError(Exception):
    """Bad flags or environment for a subcommand; the message says which and why."""


def parse_settings(
    settings_cls: type[S], argv: Sequence[str], prog: str,
    actions: Mapping[str, str] | None = None,
) -> S:
    """Flags over ``TOKENQ_*`` over defaults; :class:`UsageError` naming each bad setting.
    ``actions``: what each value of the command's ACTION does, for ``--help``."""
    from pydantic import ValidationError
    from pydantic_settings import CliApp, CliSettingsSource, SettingsError

    from tokenq.shared.settings import describe_errors

    try:
        source: CliSettingsSource[Any] = CliSettingsSource(
            settings_cls,  # type: ignore[arg-type]
            root_parser=_root_parser(settings_cls, prog, actions),
            add_argument_method=_argument_adder(settings_cls),
        )
        return CliApp.run(settings_cls, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as exc:
        problems = describe_errors(exc, settings_cls)  # type: ignore[arg-type]
        lines = "\n".join(f"  {line}" for line in problems)
        raise UsageError(f"{prog}: invalid settings:\n{lines}") from None
    except SettingsError as exc:
        raise UsageError(f"{prog}: {exc}") from None


def _root_parser(
    settings_cls: Any, prog: str, actions: Mapping[str, str] | None
) -> argparse.ArgumentParser:
    """The parser ``--help`` describes: the docstring, the actions, then the variables."""
    description = inspect.cleandoc(settings_cls.__doc__ or "")
    if actions:
        width = max(len(name) for name in actions) + 4
        description += "\n\nactions:\n" + "\n".join(
            textwrap.fill(what, 79, initial_indent=f"  {name:<{width - 2}}",
                          subsequent_indent=" " * width)
            for name, what in actions.items())
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=environment_help(settings_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


def environment_help(settings_cls: Any) -> str:
    """The ``--help`` paragraph of every ``TOKENQ_*`` variable the command reads (with its flag
    where that is spelt otherwise)."""
    from tokenq.shared.settings import env_var, flag, is_positional

    names = []
    for name in settings_cls.model_fields:
        if is_positional(settings_cls, name):
            continue
        spelt = flag(settings_cls, name)
        apart = spelt != "--" + name.replace("_", "-")
        names.append(f"{env_var(name)} ({spelt})" if apart else env_var(name))
    head = ("environment: every option is also a variable (flags win over the environment, "
            "the environment over the defaults; a switch takes true or false):")
    # A name is never cut in two: the space in "TOKENQ_AS_JSON (--json)" is held until wrapped.
    lines = textwrap.wrap(", ".join(name.replace(" ", "\0") for name in names), 77,
                          break_long_words=False, break_on_hyphens=False)
    return "\n".join(textwrap.wrap(head, 79) + ["  " + line.replace("\0", " ") for line in lines])


def _argument_adder(settings_cls: Any) -> Callable[..., Any]:
    """pydantic-settings' ``add_argument`` with tokenq's flag names, metavars and help: a
    boolean is one switch away from its default, a backend's settings go under its heading."""
    from tokenq.shared.settings import flag, group_environment, help_group

    fields = settings_cls.model_fields
    groups: dict[str, Any] = {}

    def add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
        name = str(kwargs.get("dest", names[0]))
        info = fields.get(name)
        if info is None:
            return parser.add_argument(*names, **kwargs)
        kwargs["help"] = _help_text(info)
        if isinstance(kwargs.get("metavar"), str) and str(kwargs["metavar"]).startswith("list["):
            kwargs["metavar"] = name.upper()
        if not names[0].startswith("-") and get_origin(info.annotation) is Literal:
            # A positional's values are its actions: usage and help name them.
            kwargs["metavar"] = "{" + ",".join(map(str, get_args(info.annotation))) + "}"
        if names[0].startswith("-"):
            names = (flag(settings_cls, name),)
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            # One switch, away from the default: --json, --no-progress.
            on = info.get_default() is not True
            kwargs["action"] = "store_true" if on else "store_false"
            if not on:
                names = ("--no-" + names[0].removeprefix("--"),)
                kwargs["help"] = off_help(info)
        title = help_group(settings_cls, name)
        if title is not None:
            if title not in groups:
                groups[title] = parser.add_argument_group(
                    title, group_environment(settings_cls, title))
            return groups[title].add_argument(*names, **kwargs)
        return parser.add_argument(*names, **kwargs)

    return add_argument


def off_help(info: Any) -> str:
    """What a default-on switch's ``--no-X`` does: ``json_schema_extra["off_help"]`` (the
    description says what the setting *is*)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    said = extra.get("off_help")
    return str(said) if said else f"turn off (on by default): {info.description}"


def _help_text(info: Any) -> str:
    """A field's description, then its default unless that is "unset" or "off"."""
    text = str(info.description or "")
    if info.is_required():
        return text
    default = info.get_default(call_default_factory=True)
    if default is None or default is False or default in ("", []):
        return text
    shown = "on" if default is True else f"{default:g}" if isinstance(default, float) else default
    return f"{text} (default: {shown})"
