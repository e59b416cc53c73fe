"""How the push paths word a refusal: the same text for a single push and a line of a stream."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError


def too_large(length: str, limit: int) -> str:
    return f"Request body of {length} bytes is over the limit of {limit} bytes."


def validation_problem(exc: ValidationError) -> dict[str, Any]:
    """As the FastAPI handler words a 422: the first error in ``detail``, all of them under ``body``."""
    errors: list[dict[str, Any]] = json.loads(json.dumps(shortened(exc.errors(include_url=False)), default=_printable))
    for e in errors:
        e["loc"] = ["body", *e["loc"]]
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return {"detail": f"Invalid request: {where}: {first.get('msg', 'malformed')}", "errors": errors}


ECHO_CHARS = 256
"""How much of a refused input an answer echoes: a hostile half-megabyte field would otherwise be
written back whole, and encoding it blocked the agent for longer than the refusal itself."""


def shortened(errors: list[Any]) -> list[Any]:
    """Validation errors with each echoed ``input`` cut to ``ECHO_CHARS`` of its text."""
    out = []
    for e in errors:
        e = dict(e)
        if "input" in e:
            text = e["input"] if isinstance(e["input"], str) else None
            if text is None:
                text = repr(e["input"]) if not isinstance(e["input"], int | float | bool | type(None)) else None
            if text is not None and len(text) > ECHO_CHARS:
                e["input"] = text[:ECHO_CHARS] + f"... ({len(text)} characters)"
        out.append(e)
    return out


def jsonable(value: Any) -> Any:
    """``value`` with what strict JSON cannot hold made text: NaN and infinities, lone surrogates."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {jsonable(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _printable(value: object) -> str:
    """JSON for what pydantic puts in an error: the raw input (maybe not UTF-8) or an exception."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
