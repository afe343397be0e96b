"""Reading a rank's ordered events (collectives, messages, waits, matrix products, marks): what
ran between a handle's issue and its wait. Shared by the chapter's mechanism checks."""
from __future__ import annotations


def wait_of(events: list, index: int) -> int | None:
    """The index of the wait on event `index`'s handle, or None if it was never waited on."""
    return next((i for i in range(index + 1, len(events))
                 if events[i]["op"] == "wait" and events[i].get("of") == index), None)


def products_between(events: list, start: int, stop: int) -> int:
    return sum(event["op"] == "compute" for event in events[start + 1:stop])


def between_marks(events: list, start: str, stop: str | None) -> range:
    labels = [event.get("label") for event in events]
    begin = labels.index(start)
    end = labels.index(stop) if stop is not None else len(events)
    return range(begin + 1, end)


def unexpected_ops(events: list, allowed: set) -> list[str]:
    return sorted({event["op"] for event in events} - allowed - {"wait", "mark", "compute"})
