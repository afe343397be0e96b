"""The class's most common mistakes per exercise, from the feedback of the checks.

A check that recognises a slip names it: `compare.expect_answer` writes
`<call> is <answer>, expected <right answer>: <the slip's text>`. Inputs are drawn at random for
every notebook, so the call and the two numbers differ from student to student; the slip's text
is what stays (with its own numbers, if it quotes any, blanked for the comparison). Feedback of
another form is grouped by its whole text with the numbers and the arguments of calls blanked.
`error`, `timeout` and `missing` are counted as one category each: their texts are the learners'
own exceptions, not diagnoses."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

MISTAKES_SHOWN = 3  # named failure kinds per exercise; the rest is summed in one line
STATUS_CATEGORIES = ("error", "timeout", "missing")

_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:[eE][-+]?\d+)?|\b(?:inf|nan)\b")
_CALL = re.compile(r"\b([A-Za-z_][\w.]*)\((?:[^()]|\([^()]*\))*\)")
# expect_answer's wording (grader/compare.py); numbers there are written with :.6g, without spaces
_NAMED_SLIP = re.compile(r"^(?P<what>.*?) is \S+, expected \S+: (?P<slip>.+)$")


@dataclass(frozen=True)
class Mistake:
    key: tuple  # what is counted alike
    label: str  # what the summary shows


def blanked(text: str) -> str:
    """`text` with numbers and the arguments of calls replaced: what two students' feedback on
    the same mistake share although their inputs were drawn differently."""
    return _NUMBER.sub("#", _CALL.sub(r"\1(…)", text))


def mistake_of(outcome: dict) -> Mistake | None:
    """The mistake an exercise's outcome shows; None when it passed or was not handed in."""
    status, feedback = outcome["status"], outcome["feedback"]
    if status in STATUS_CATEGORIES:
        label = "missing: not implemented" if status == "missing" else f"{status} (for example: {feedback})"
        return Mistake((status,), label)
    if status != "failed":
        return None
    named = _NAMED_SLIP.match(feedback)
    if named:
        function = re.match(r"([A-Za-z_]\w*)\(", named["what"])
        where = f"{function[1]}: " if function else ""
        return Mistake(("slip", where, blanked(named["slip"])), where + named["slip"])
    return Mistake(("feedback", blanked(feedback)), _CALL.sub(r"\1(…)", feedback))  # a config's repr is long


@dataclass
class MistakeCount:
    label: str  # the first student's wording (in the class's order), calls' arguments left out
    students: int
    named: bool  # a failure's diagnosis, not a status category


def common_mistakes(outcomes: list[dict]) -> list[MistakeCount]:
    """The mistakes among `outcomes` (one per student), most common first: the MISTAKES_SHOWN most
    common failure diagnoses, one line summing the other failures, then the status categories."""
    counts: Counter = Counter()
    labels: dict[tuple, str] = {}
    for outcome in outcomes:
        mistake = mistake_of(outcome)
        if mistake is not None:
            counts[mistake.key] += 1
            labels.setdefault(mistake.key, mistake.label)
    failures = sorted((key for key in counts if key[0] not in STATUS_CATEGORIES),
                      key=lambda key: (-counts[key], labels[key]))
    listed = [MistakeCount(labels[key], counts[key], True) for key in failures[:MISTAKES_SHOWN]]
    rest = failures[MISTAKES_SHOWN:]
    if rest:
        listed.append(MistakeCount(f"{len(rest)} other kinds of failure (see the students' reports)",
                                   sum(counts[key] for key in rest), True))
    listed += [MistakeCount(labels[(status,)], counts[(status,)], False)
               for status in STATUS_CATEGORIES if counts[(status,)]]
    return listed
