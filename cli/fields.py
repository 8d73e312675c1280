"""Command-line flags generated from the REST request schemas, so the CLI takes every field the API
takes, under the same name, with the same default and the same validation.

`ftc submit` reads `service.schemas.JobRequest` and `ftc sweep create` reads
`service.sweeps.SweepRequest`: each field becomes one flag (`calibration.seq_len` is
`--calibration-seq-len`, `eval.max_windows` is `--eval-max-windows`), with the field's description
as help and its default shown. A field added to the schema is a flag from then on, with no edit
here; a `Literal` field offers its values as choices, a list takes commas. Flags left out are not
sent, so the server's default applies, and it is the very default the help shows.

A few fields also answer to the shorter names `ftc compress` and `ftc eval` use (`--calib`,
`--seq-len`, `--tasks`, ...), so the same words work locally and on the service.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from service.schemas import UPLOAD_SCHEMES

Path_ = tuple[str, ...]

SHORT_NAMES: dict[Path_, tuple[str, ...]] = {
    ("calibration", "dataset"): ("--calib",),
    ("calibration", "samples"): ("--calib-samples",),
    ("calibration", "seq_len"): ("--seq-len",),
    ("calibration", "seed"): ("--seed",),
    ("eval", "max_windows"): ("--max-windows",),
    ("eval", "tasks"): ("--tasks",),
    ("eval", "limit"): ("--limit",),
}
"""The names `ftc compress` / `ftc eval` give the same settings, accepted beside the API's."""

UPLOADABLE: frozenset[Path_] = frozenset({("calibration", "dataset"), ("eval", "datasets")})
"""Dataset fields where a local file is uploaded first and replaced by its upload URI."""

PENDING_UPLOAD = UPLOAD_SCHEMES[0] + "pending-upload/"
"""What a local file stands as while the request is checked, before anything is uploaded: an
upload name of the kind the schema accepts."""


@dataclass(frozen=True)
class Flag:
    """One request field as a command-line flag."""

    path: Path_
    """Where the value goes in the JSON request, by the API's names (`("eval", "tasks")`)."""
    names: tuple[str, ...]
    dest: str
    kind: str
    """How the text is read: scalar, list, or sets (a list of lists: `a,b;c`)."""
    item: Any
    """The type of the value, or of each item of a list: str, int, float, bool."""
    choices: tuple[str, ...] | None
    default: Any
    required: bool
    help: str

    @property
    def field(self) -> str:
        return ".".join(self.path)


def _strip(annotation: Any) -> Any:
    """The type under `Annotated[...]` and `X | None`."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(rest) != 1:
                return annotation
            annotation = rest[0]
        else:
            return annotation


def _literal(annotation: Any) -> tuple[str, ...] | None:
    return tuple(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else None


def _shape(annotation: Any) -> tuple[str, Any, tuple[str, ...] | None]:
    """(kind, element type, choices) of a field's type."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) is list:
        item = _strip(typing.get_args(annotation)[0])
        if typing.get_origin(item) is list:
            return "sets", _strip(typing.get_args(item)[0]), None
        return "list", item, _literal(item)
    return "scalar", annotation, _literal(annotation)


def _default_text(value: Any, kind: str) -> str:
    if value is None:
        return "none"
    if kind == "sets":
        return ";".join(",".join(items) or "none" for items in value)
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fields(model: type[BaseModel], prefix: Path_ = ()) -> Iterator[tuple[Path_, FieldInfo]]:
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        nested = _strip(info.annotation)
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            yield from _fields(nested, path)
        else:
            yield path, info


def flags_of(model: type[BaseModel], skip: frozenset[Path_] = frozenset()) -> list[Flag]:
    """Every field of `model` (nested sections flattened) but those in `skip`, as flags."""
    flags = []
    for path, info in _fields(model):
        if path in skip:
            continue
        kind, item, choices = _shape(info.annotation)
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        text = (info.description or info.title or path[-1].replace("_", " ")).rstrip(".")
        if choices:
            text += f"; {'one' if kind == 'scalar' else 'separated by commas, any'} of {', '.join(choices)}"
        elif kind == "list":
            text += "; separated by commas"
        elif kind == "sets":
            text += "; sets separated by ';', items by ',' ('none' for an empty set)"
        if not info.is_required() and "(default:" not in text:
            text += f" (default: {_default_text(default, kind)})"
        names = ("--" + "-".join(path).replace("_", "-"), *SHORT_NAMES.get(path, ()))
        dest = "field__" + "__".join(path)
        flags.append(Flag(path, names, dest, kind, item, choices, default, info.is_required(), text))
    return flags


def _reader(flag: Flag) -> Callable[[str], Any]:
    """The argparse `type` of a flag: text to the JSON value the API takes."""

    item = flag.item

    def scalar(text: str) -> Any:
        try:
            value = item(text) if item in (int, float) else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {item.__name__}; got {text!r}") from None
        if flag.choices and value not in flag.choices:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(flag.choices)})")
        return value

    def items(text: str) -> list[Any]:
        return [scalar(part.strip()) for part in text.split(",") if part.strip()]

    if flag.kind == "sets":
        return lambda text: [[] if part.strip() in ("", "none") else items(part) for part in text.split(";")]
    return items if flag.kind == "list" else scalar


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    """Add the flags to `parser`; each defaults to None, meaning 'not sent: the server's default'."""
    for flag in flags:
        if flag.kind == "scalar" and flag.item is bool:  # --eval-dense-reference / --no-eval-dense-reference
            parser.add_argument(*flag.names, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=flag.help)
            continue
        metavar = "|".join(flag.choices) if flag.choices and flag.kind == "scalar" else flag.path[-1].upper()
        parser.add_argument(*flag.names, dest=flag.dest, type=_reader(flag), default=None,
                            required=flag.required, metavar=metavar, help=flag.help)


def request_from(args: argparse.Namespace, flags: list[Flag], upload: Callable[[Path], str]) -> dict[str, Any]:
    """The JSON request the given flags describe (flags left out are not sent).

    A dataset that names an existing local file becomes `upload(path)`, the URI of its upload.
    """
    request: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if flag.path in UPLOADABLE:
            value = _uploaded(value, upload)
        section = request
        for key in flag.path[:-1]:
            section = section.setdefault(key, {})
        section[flag.path[-1]] = value
    return request


def _uploaded(value: str | list[str], upload: Callable[[Path], str]) -> str | list[str]:
    def one(name: str) -> str:
        return upload(Path(name)) if name and Path(name).is_file() else name

    return [one(name) for name in value] if isinstance(value, list) else one(value)


def pending_upload(path: Path) -> str:
    """Stands for a local file until it is uploaded: a URI the schema accepts, uploading nothing."""
    return PENDING_UPLOAD + path.name


def check_request(model: type[BaseModel], request: dict[str, Any], flags: list[Flag]) -> None:
    """Validate `request` with the API's own schema, before anything is uploaded or sent.

    Raises ValueError with one line naming each bad flag, as the API's 422 names each field.
    """
    try:
        model.model_validate(request)
    except ValidationError as error:
        by_path = {flag.path: flag.names[0] for flag in flags}
        problems = []
        for item in error.errors():
            loc = tuple(str(part) for part in item["loc"] if not isinstance(part, int))
            message = str(item["msg"]).removeprefix("Value error, ")
            name = by_path.get(loc) or ".".join(loc)  # a section's own rule names the section, as the API does
            problems.append(f"{name}: {message}" if name else message)
        raise ValueError("; ".join(problems)) from None
