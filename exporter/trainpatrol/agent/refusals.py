"""How a command that cannot be carried out is refused: the same words from the API and the webhook."""

from __future__ import annotations


def no_live_rank(run: str, namespace: str = "") -> str:
    """The refusal of a command that no rank of ``run`` could carry out (the CLI prints it as it is)."""
    return f"no live rank of run {run}{f' in namespace {namespace}' if namespace else ''} on this agent"


def rate_limited(run: str, namespace: str, action: str, limit: int) -> str:
    where = f" in namespace {namespace!r}" if namespace else ""
    return f"Run {run!r}{where} had {limit} {action} actions in the last 60 s, the limit; retry later."
