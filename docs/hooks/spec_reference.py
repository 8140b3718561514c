"""mkdocs hook: the experiment spec and profile references, generated from the pydantic
models at build time, so the pages cannot fall behind the code."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MARKERS = {"<!-- experiment-spec -->": "ExperimentSpec", "<!-- trim-profile -->": "TrimProfile"}


def _models(annotation) -> list[type[BaseModel]]:
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in args for m in _models(a)]


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text or str(annotation))  # trimlab.spec.X -> X
    return text.replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _models(f.annotation)
        if f.default_factory is not None:
            default = "(a section)" if nested else repr(f.default_factory())
        else:
            default = "required" if f.default is PydanticUndefined else repr(f.default)
        desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{key}` | {_type(f.annotation)} | {default} | {desc} |")
        for m in nested:
            out += _rows(m, f"{key}.")
    return out


def table(model_name: str) -> str:
    from trimlab import spec
    model = getattr(spec, model_name)
    out = "\n".join(["| key | type | default | what it is |", "| --- | --- | --- | --- |", *_rows(model)])
    if model_name == "ExperimentSpec":
        out += "\n\nSweepable keys: " + ", ".join(f"`{k}`" for k in spec.SWEEPABLE) + "."
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, model in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, table(model))
    return markdown
