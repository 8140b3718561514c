"""The JSON lines agents print on stdout (trimlab.agents.logs.log_event), parsed into
typed events for the controller: nothing else in the orchestrator reads those lines."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Listening:
    """A capture or traffic sink is ready."""


@dataclass(frozen=True)
class Step:
    role: str  # worker | ps
    step: int
    rank: int | None = None
    loss: float | None = None
    trimmed: int = 0
    test_acc: float | None = None


@dataclass(frozen=True)
class Done:
    """An agent's, or a DDP script's, final line."""

    role: str | None
    rank: int | None
    checksum: str | None
    test_acc: float | None
    steps: int | None = None  # the steps it ran (a DDP script: fewer where its time limit stopped it)
    time_limit: bool = False


Event = Listening | Step | Done


def _number(v):
    return None if v in (None, "") else v


def parse(line: str) -> Event | None:
    """The event on one output line; None for anything else (plain log lines too)."""
    if not line.startswith("{"):
        return None
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    if not isinstance(ev, dict):
        return None
    kind = ev.get("event")
    if kind == "listening":
        return Listening()
    if kind == "step" and isinstance(ev.get("step"), int):
        return Step(role=ev.get("role", "worker"), step=ev["step"], rank=ev.get("rank"), loss=_number(ev.get("loss")),
                    trimmed=int(ev.get("trimmed") or 0), test_acc=_number(ev.get("test_acc")))
    if kind == "done":
        return Done(role=ev.get("role"), rank=ev.get("rank"), checksum=ev.get("checksum"),
                    test_acc=_number(ev.get("test_acc")), steps=_number(ev.get("steps")),
                    time_limit=bool(ev.get("time_limit")))
    return None
