"""Command-line flags declared once: a `Flag` holds a flag's names, group, default, choices and
help, and parsers (the trainers', the tools') and docs/FLAGS.md are generated from them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Iterable

MODELS = ("gpt", "t5")


@dataclass(frozen=True)
class Flag:
    """One flag. `kwargs` go to `add_argument` as they are, except `help`, which may be a dict
    per model. `models`: the models whose --help shows it (the others still accept it, and
    their config check rejects it with a message). `exclusive`: flags of a group with the same
    key are mutually exclusive. `field`: the TrainConfig field it fills, None when a resolver
    derives the field (arguments.resolved_fields); `negate`: the field is `not value`.
    `validated_by`: the class that checks the value against `choices` (the trainer's config
    check then leaves it to that class)."""

    names: tuple[str, ...]
    group: str
    kwargs: dict = field(default_factory=dict)
    models: tuple[str, ...] = MODELS
    exclusive: str | None = None
    field: str | None = ""       # "": the dest
    negate: bool = False
    validated_by: str | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.name.lstrip("-").replace("-", "_")

    @property
    def field_name(self) -> str | None:
        return self.dest if self.field == "" else self.field

    @property
    def default(self):
        if "default" in self.kwargs:
            return self.kwargs["default"]
        return {"store_true": False, "store_false": True}.get(self.kwargs.get("action"))

    @property
    def choices(self):
        return self.kwargs.get("choices")

    def help_for(self, model: str | None) -> str | None:
        text = self.kwargs.get("help")
        if isinstance(text, dict):
            text = text.get(model, text.get(None))
        return text

    def shown_for(self, model: str | None) -> bool:
        return model is None or model in self.models

    def add_to(self, container, model: str | None = None, aliases: tuple[str, ...] = (),
               **overrides) -> argparse.Action:
        """`add_argument` on a parser or group; `overrides` replace declared keywords
        (a tool's own default, `required=False`); `aliases`: a tool's extra spellings."""
        kwargs = {k: v for k, v in self.kwargs.items() if k != "help"}
        if aliases:
            kwargs["dest"] = self.dest
        text = self.help_for(model)
        if not self.shown_for(model):
            text = argparse.SUPPRESS
        if text is not None:
            kwargs["help"] = text
        kwargs.update(overrides)
        return container.add_argument(*self.names, *aliases, **kwargs)


def flag_by_dest(flags: Iterable[Flag], dest: str) -> Flag:
    for f in flags:
        if f.dest == dest:
            return f
    raise KeyError(f"no flag declares {dest!r}")


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], titles: dict[str, str],
              model: str | None = None, overrides: dict[str, dict] | None = None) -> None:
    """Add `flags` to `parser` in their order, each in the argument group `titles[group]`
    (made on first use; a title already on the parser is reused; "": the parser itself),
    mutually exclusive sets together. `overrides`: per dest, keywords that replace the
    declared ones."""
    groups = {g.title: g for g in parser._action_groups}
    exclusive = {}
    for f in flags:
        title = titles[f.group]
        if title == "":
            groups[title] = parser
        elif title not in groups:
            groups[title] = parser.add_argument_group(title)
        container = groups[title]
        if f.exclusive:
            key = (title, f.exclusive)
            if key not in exclusive:
                exclusive[key] = container.add_mutually_exclusive_group()
            container = exclusive[key]
        f.add_to(container, model, **(overrides or {}).get(f.dest, {}))


def markdown_table(flags: Iterable[Flag], models: tuple[str, ...] = MODELS) -> str:
    """A Markdown table of `flags`: flag, default, choices, help (per model where it differs),
    marked "(T5 only)" and the like when not every model's --help shows it."""
    rows = ["| flag | default | choices | help |", "|---|---|---|---|"]
    for f in flags:
        names = ", ".join(f"`{n}`" for n in f.names)
        if f.kwargs.get("required"):
            default = "required"
        else:
            default = "" if f.default is None else f"`{format_value(f.default)}`"
        choices = ", ".join(f"`{c}`" for c in f.choices) if f.choices else ""
        shown = [m for m in models if f.shown_for(m)]
        texts = {m: escape(f.help_for(m) or "") for m in shown}
        if len(set(texts.values())) <= 1:
            text = next(iter(texts.values()), "")
        else:
            text = "<br>".join(f"pretrain_{m}.py: {t}" for m, t in texts.items())
        if len(shown) < len(models):
            text = f"({' and '.join(m.upper() for m in shown)} only) " + text
        rows.append(f"| {names} | {default} | {choices} | {text} |")
    return "\n".join(rows)


def format_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def escape(text: str) -> str:
    """Help text as one Markdown table cell (argparse's %% is %)."""
    return (text.replace("%%", "%").replace("&", "&amp;").replace("<", "&lt;")
            .replace("|", "\\|").replace("\n", " "))
