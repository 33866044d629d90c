"""What a task file's problems read like: one line each, with the field, the problem and the fix.

Task files are written by people in a hurry, so a problem names where it is
and what to write instead, never only what pydantic or PyYAML found:

- :func:`read_yaml`: the file as YAML, a syntax error as one line with its
  line and column (a tab in the indentation says so), a file that is not text
  as such, and a key given twice refused (PyYAML keeps the last silently: a
  field filled in under the TODO line ``tasks new`` wrote would be ignored);
- :func:`todo_fields`: every value still marked ``TODO``, by field;
- :func:`task_name_problem`: a task name that cannot name a run directory and
  an exported kernel;
- :func:`validation_messages`: pydantic's errors as ``field: problem; fix``:
  an unknown field with the field it misspells (and not that field again as
  missing), a literal with the spelling it means (``bfloat16``: write
  ``bf16``), an empty value, a scalar where a list or mapping goes.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from coda_agent.errors import CodaError


TODO = "TODO"  # a value a person still has to fill in (``coda-agent tasks new`` writes them)


class TaskSpecError(CodaError, ValueError):
    """A task file that cannot be used; the message names file, field and fix."""


def todo_fields(raw: Any, where: str = "") -> list[tuple[str, str]]:
    """(field, text) of every value still marked ``TODO ...``, in file order."""
    if isinstance(raw, str):
        return [(where or "(top level)", raw)] if raw.strip().startswith(TODO) else []
    if isinstance(raw, dict):
        return [f for k, v in raw.items() for f in todo_fields(v, f"{where}.{k}" if where else str(k))]
    if isinstance(raw, list):
        return [f for i, v in enumerate(raw) for f in todo_fields(v, f"{where}[{i}]")]
    return []


def task_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a task (None when it can): it names the run directories
    (``runs/<utc>-<name>-<author>``) and, with other characters than letters, digits and ``_``
    made ``_``, the exported module and its function."""
    if not name.strip():
        return "is empty; give the task a name, e.g. geglu"
    if "/" in name or "\\" in name:
        better = re.sub(r"[/\\]", "_", name)
        return f"{name!r} contains a path separator; a task name is a name, not a path (e.g. {better!r})"
    if not re.sub(r"\W", "_", name).isidentifier():
        return (f"{name!r} does not start with a letter or _; the exported kernel is a Python function of that "
                f"name (e.g. 'op_{name}')")
    return None


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping.  PyYAML keeps the
    last one silently, so a field filled in below the TODO line ``tasks new`` wrote would be
    ignored (or the TODO would win, over the value the person just wrote)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: construct_mapping itself reports it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice (first on line "
                                                        f"{first.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line: where, what, and the fix (PyYAML's own text spans several, with a caret)."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return f"{path}: not valid YAML: {' '.join(str(e).split())}"
    mark = e.problem_mark
    text = f"{path}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    if e.context and e.context_mark is not None and e.context_mark.line != mark.line:
        text += f" ({e.context} on line {e.context_mark.line + 1})"
    if "'\\t'" in str(e.problem):
        return text + "; indent with spaces (YAML does not allow tabs there)"
    if "given twice" in str(e.problem):
        return text
    return text + "; fix the YAML there (a quoted string, a closed bracket, a colon and space after each key)"


def read_yaml(path: Path) -> Any:
    """The file's YAML (None for an empty file); a problem as a one-line TaskSpecError."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskSpecError(f"{path}: not a text file (byte {e.start} is not UTF-8); give the task's YAML "
                            "file") from None
    except OSError as e:
        raise TaskSpecError(f"{path}: cannot read it ({e.strerror}); give a readable task YAML") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise TaskSpecError(_yaml_error(path, e)) from None


# Dtype spellings of other tools, and what a task file calls them.
DTYPE_ALIASES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "torch.float16": "fp16", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                 "f32": "fp32", "f16": "fp16", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3",
                 "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "int": "int64", "long": "int64",
                 "torch.int64": "int64", "torch.int32": "int32", "i64": "int64", "i32": "int32"}


def _suggest(word: Any, options: list[str]) -> str:
    """``; did you mean 'x'?`` for a near miss of one of ``options``, else empty."""
    if not isinstance(word, str):
        return ""
    if DTYPE_ALIASES.get(word.lower()) in options:
        return f"; write {DTYPE_ALIASES[word.lower()]!r}"
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model whose fields the mapping at ``loc`` holds (``root`` at the top), or None."""
    model: Any = root
    i = 0
    while i < len(loc):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or loc[i] not in model.model_fields:
            return None
        ann = model.model_fields[loc[i]].annotation
        args = [a for a in get_args(ann) if a is not type(None)]
        if get_origin(ann) is dict:
            if i + 1 == len(loc):
                return None  # the mapping of names itself, not one of its entries
            model, i = args[1], i + 2  # the key names a tensor or an output: skip it
        else:
            model, i = (args[0] if args else ann), i + 1
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _loc(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def validation_messages(e: ValidationError, root: type[BaseModel]) -> list[str]:
    """pydantic's errors as ``field: problem; fix`` lines: an unknown field with the one it
    misspells (and not also that one as missing), a literal with the spelling it means."""
    errors = e.errors()
    unknown = {}
    for err in errors:
        if err["type"] == "extra_forbidden":
            model = _model_at(root, err["loc"][:-1])
            fields = list(model.model_fields) if model else []
            close = difflib.get_close_matches(str(err["loc"][-1]), fields, n=1, cutoff=0.6)
            unknown[err["loc"]] = (close[0] if close else None, fields)
    meant = {(*loc[:-1], close) for loc, (close, _) in unknown.items() if close}
    lines = []
    for err in errors:
        loc, kind = err["loc"], err["type"]
        msg = err["msg"].removeprefix("Value error, ")
        msg = re.sub(r" or instance of \w+$", "", msg)
        if kind == "missing" and loc in meant:
            continue  # said with the misspelling that meant it
        if kind == "extra_forbidden":
            close, fields = unknown[loc]
            msg = (f"unknown field; did you mean {close!r}?" if close else
                   f"unknown field; remove it (the fields here: {', '.join(fields)})" if fields else
                   "unknown field; remove it or fix its spelling")
        elif kind == "missing":
            msg = "required field is missing; add it"
        elif kind == "literal_error":
            options = [str(o) for o in re.findall(r"'([^']*)'", msg)]
            msg = f"{err['input']!r} is not one of {', '.join(options)}{_suggest(err['input'], options)}"
        elif err.get("input") is None and kind.endswith("_type"):
            msg = "is empty; fill it in"
        elif loc[:1] == ("shapes",) and kind.startswith("int_"):
            msg = f"{err['input']!r} is not an integer; a shape set binds each symbol to a whole number"
        elif kind == "list_type":
            example = err["input"] if isinstance(err["input"], (str, int, float)) else "..."
            msg = f"{err['input']!r} is not a list; write a YAML list, e.g. [{example}]"
        elif kind in ("dict_type", "model_type", "model_attributes_type"):
            model = _model_at(root, loc)
            msg = (f"{err['input']!r} is not a mapping; write {{field: value, ...}} with its fields "
                   f"({', '.join(model.model_fields)})" if model else
                   f"{err['input']!r} is not a mapping; write {{name: ..., ...}}, one entry per name")
        lines.append(f"{_loc(loc)}: {msg}" if loc else msg)
    return lines
