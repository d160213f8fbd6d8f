"""One line for a failed pydantic validation: the dotted field, what is wrong and what is allowed.

Shared by the scenario (sim/config.py) and the device presets (sim/devices.py), so a mistyped key reads the same
wherever it is: "device.hbm_gbs: unknown key; allowed: ...".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def describe_validation_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line for the first error: the dotted field (from `root`, the model validated), what is wrong and what
    is allowed."""
    errors = exc.errors(include_url=False)
    # a misspelt key explains the "missing" error that comes with it, so report unknown keys first
    err = next((e for e in errors if e["type"] == "extra_forbidden"), None)
    if err is None:  # of a union's failed branches, the deepest says most (a list's bad element, not "no list")
        same = [e for e in errors if e["loc"][:2] == errors[0]["loc"][:2]]
        err = max(same, key=lambda e: len(e["loc"]))
    # union branches and validators appear in loc as e.g. "constrained-float" or "list[...]": not fields
    loc = [str(p) for p in err["loc"] if not any(ch in str(p) for ch in "-[") and str(p) != "float"]
    field = ".".join(loc) or "scenario"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, loc[:-1])
        return f"{field}: unknown key; allowed: {', '.join(allowed)}"
    if kind == "missing":
        return f"{field}: missing required key"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        # validators phrase their own message starting with the field they name
        head = msg.split(":", 1)[0]
        if "." in head or head in {"scenario"}:
            return msg
        return f"{'.'.join([*loc, head]) if loc else head}:{msg.split(':', 1)[1]}" if ":" in msg else msg
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    hint = ""
    if kind != "list_type" and any(e["type"] == "list_type" for e in same):  # the union's per-chunk list form
        hint = f"; or a list, {_list_item(root, loc)} per chunk"
    return f"{field}: {msg.lower()}{shown}{hint}"


def _list_item(root: type[BaseModel], loc: list[str]) -> str:
    """How a per-chunk list field's entries are named in a message: "one bool", "one value"."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return "one value"
        model = field.annotation
        inner = [a for a in getattr(model, "__args__", (model,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = inner[0] if inner else model
    lists = [a for a in getattr(model, "__args__", ()) if getattr(a, "__origin__", None) is list]
    item = lists[0].__args__[0] if lists else None
    return "one bool" if item is bool else "one value"


def _allowed_keys(root: type[BaseModel], loc: list[str]) -> list[str]:
    """The keys of the table at `loc` under `root`."""
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            break
        ann = field.annotation
        options = getattr(ann, "__args__", (ann,))
        inner = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if inner is None:
            break
        model = inner
    return list(model.model_fields)

