"""Pieces that checks of every chapter share: closed-form checks, gloo world limits, and the
communication log in a form that crosses from the sandbox to the grader."""
from __future__ import annotations

from dtp.common.world import LAZY_TORCH_MODULES, run_world

from ..compare import CheckFailed, RanksFailed, expect_answer, world_failure
from ..registry import Check
from ..sandbox import seconds_left


def world_options() -> dict:
    """Limits for a check's gloo world within the exercise's time limit: a deadlocked collective
    must time out (and be reported as a deadlock) well before the sandbox is killed."""
    left = seconds_left()
    return dict(timeout_s=left, collective_timeout_s=min(8.0, left / 3))


def run_worlds(fn, worlds: list[tuple[int, tuple]]) -> list:
    """In the sandbox: `fn` on one gloo world per (world size, args), in order, stopping at the
    first world that fails. A failed world comes back as {"failed_world": n, "status", "feedback"},
    so that the worlds before it are still judged (a ring that only works for n = 2 fails on what
    it sent for n = 2, and the n = 3 failure is reported only if nothing before it was wrong).
    The grader imported the check's `preimport` before forking this sandbox (grade_exercise), so
    the ranks inherit it and nothing is imported here."""
    from dtp.common.world import WorldError

    outcomes = []
    for world_size, args in worlds:
        try:
            outcomes.append(run_world(fn, world_size, args, preimport=(), **world_options()))
        except WorldError as error:
            status, feedback = world_failure(error)
            outcomes.append({"failed_world": world_size, "status": status, "feedback": feedback})
            break
    return outcomes


def completed_worlds(outcomes: list) -> tuple[list, dict | None]:
    """In the judge: (the outcomes of the worlds that completed, the failed world or None)."""
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, dict) and "failed_world" in outcome:
            return outcomes[:index], outcome
    return outcomes, None


def raise_world_failure(failure: dict | None) -> None:
    if failure is not None:
        status, feedback = str(failure["status"]), str(failure["feedback"])
        raise RanksFailed(status, feedback if status == "missing" else
                          f"with {failure['failed_world']} processes: {feedback}")


class WorldsCheck(Check):
    """A check that runs the learner's code in gloo worlds (`run_worlds` in `collect`): `judge`
    judges each world that completed, in order (`judge_world(inputs of the world, its per-rank
    outcomes)`, raising CheckFailed), then reports the world that failed, if any, and returns
    `summary`, the pass line."""

    runs_world = True
    preimport = LAZY_TORCH_MODULES
    summary = ""

    def judge_world(self, world, per_rank: list) -> None:
        raise NotImplementedError

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for world, per_rank in zip(worlds, done):
            self.judge_world(world, per_rank)
        raise_world_failure(failure)
        return self.summary


def events_as_data(log, payloads: bool = False) -> list[dict]:
    """A CommunicationLog's events as plain data (payload tensors as arrays when asked for)."""
    keep = ("op", "bytes", "peer", "root", "of", "label", "group")
    events = []
    for event in log.events:
        plain_event = {key: event[key] for key in keep if key in event}
        if payloads and "payload" in event:
            plain_event["payload"] = [t.numpy() for t in event["payload"]]
        events.append(plain_event)
    return events


def clear_of_integers(value: float, rel: float = 1e-9) -> bool:
    """Whether `value` lies farther than `rel` of itself from every integer. An answer that rounds a
    quotient up or down (the fewest tokens, GPUs or chunks) is drawn only where this holds: where
    the exact quotient is an integer, float arithmetic in another (algebraically equal) order lands
    just above or below it, and a right answer comes out one off."""
    return abs(value - round(value)) > rel * abs(value)


def describe_call(function: str, args: tuple, kwargs: dict) -> str:
    def show(value):
        return f"{value:.4g}" if isinstance(value, float) else repr(value)
    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{function}({', '.join(parts)})"


class InterviewQuestions(Check):
    """Interview questions answered as functions of the question's numbers: each function in
    `reads` is called on the question's own numbers (`asked`, as the notebook states them) and on
    numbers drawn at random (`drawn`), and compared with `expected`; a wrong answer equal to a
    known slip gets that slip's feedback. A number copied from the page, or a table of answers,
    cannot match the drawn questions, and the course's functions (`references`) trip.

    Subclasses set `reads` and `asked` (name -> the question's arguments), and define
    `drawn(name, rng)` (arguments of one random question), `expected(name, *args)` and, where a
    mistake is common, `slips(name, *args)` (feedback -> the value it gives)."""

    timeout_s = 15
    asked: dict[str, tuple] = {}
    draws = 4  # random questions per function, besides the one asked
    rel = 1e-6
    summary = "every interview answer is right for the questions asked and for random numbers"

    def drawn(self, name: str, rng) -> tuple:
        raise NotImplementedError

    def expected(self, name: str, *args) -> float:
        raise NotImplementedError

    def slips(self, name: str, *args) -> dict[str, float]:
        return {}

    def prepare(self, rng):
        return {name: [tuple(self.asked[name])] + [tuple(self.drawn(name, rng)) for _ in range(self.draws)]
                for name in self.reads}

    def collect(self, student, questions):
        answers = {}
        for name, cases in questions.items():
            function = getattr(student, name)
            if not callable(function):  # a number copied from the page, as these questions once were
                raise CheckFailed(f"{name} is a {type(function).__name__}; it should be a function of the question's "
                                  f"numbers, which the grader calls on the question asked and on others")
            answers[name] = [function(*args) for args in cases]
        return answers

    def judge(self, questions, answers) -> str:
        for name, cases in questions.items():
            given = answers.get(name) if isinstance(answers, dict) else None
            if not isinstance(given, list) or len(given) != len(cases):
                raise CheckFailed(f"the grader's calls of {name} did not all return")
            for args, answer in zip(cases, given):
                expect_answer(answer, self.expected(name, *args), describe_call(name, args, {}), rel=self.rel,
                              slips=self.slips(name, *args))
        return self.summary


class FormulaCheck(Check):
    """A learner's function of numbers, called on random arguments drawn by `cases` and compared
    with `expected`; a wrong answer that equals a known slip gets that slip's feedback.

    Verifies: the value for every drawn case, within `rel`.
    Fakes: a table of answers cannot match freshly drawn inputs; the course's own function
    (`references`) trips when called.
    """

    function: str = ""
    rel: float = 1e-9
    timeout_s = 15  # calls of a function of numbers
    summary: str = ""  # the pass line: what was verified, in the exercise's own terms

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.function,)

    def cases(self, rng) -> list[tuple[tuple, dict]]:
        raise NotImplementedError

    def expected(self, *args, **kwargs) -> float:
        raise NotImplementedError

    def slips(self, *args, **kwargs) -> dict[str, float]:
        return {}

    def prepare(self, rng):
        return self.cases(rng)

    def collect(self, student, cases):
        function = getattr(student, self.function)
        return [function(*args, **kwargs) for args, kwargs in cases]

    def judge(self, cases, answers) -> str:
        if len(answers) != len(cases):
            raise CheckFailed("the grader's calls did not all return")
        for (args, kwargs), answer in zip(cases, answers):
            expect_answer(answer, self.expected(*args, **kwargs), describe_call(self.function, args, kwargs),
                          rel=self.rel, slips=self.slips(*args, **kwargs))
        return self.summary
