"""Typed errors. Library code raises these; only the CLI turns them into exit codes and text.

`InputError` (exit 2): the user asked for something invalid; `flag` names what to change and the
message says how. `NoFitError` (exit 1): the request is valid but no configuration fits; it carries
the suggestions that would.
"""

from __future__ import annotations


class TrainplanError(Exception):
    """Base of every error trainplan raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, flag: str | None = None, hint: str | None = None,
                 keyword: str | None = None, changes: dict | None = None):
        super().__init__(message)
        self.message = message
        self.flag = flag
        self.hint = hint
        self.keyword = keyword  # the library argument to fix, where it is not the flag's field (Plan.emit's folder)
        #: the request's fields that, changed so, get past this error: the flags the hint names, as values (None:
        #: drop the flag), which tests/test_hints_replan.py gives back to `plan`
        self.changes = dict(changes or {})

    def __str__(self) -> str:
        """The error as a library caller reads it: the keyword to fix where one is named, else the flag."""
        return self._text(self.keyword or self.flag)

    def cli_text(self) -> str:
        """The error as the command line says it: the flag to fix."""
        return self._text(self.flag)

    def _text(self, what: str | None) -> str:
        text = f"{what}: {self.message}" if what else self.message
        return f"{text}\n{self.hint}" if self.hint else text


class InputError(TrainplanError):
    """Bad input: a flag or argument with a value we cannot use."""


class ModelNotFoundError(InputError):
    """The model source could not be resolved offline (or online)."""


class UnknownGPUError(InputError):
    """A GPU name that is not in the catalog, or matches several entries."""


class NoFitError(TrainplanError):
    """No configuration fits the hardware; `suggestions` say what would."""

    exit_code = 1

    def __init__(self, message: str, *, suggestions: list[str] | None = None, plan=None, levers=()):
        super().__init__(message)
        self.suggestions = suggestions or []
        self.plan = plan  # the (rejected) Plan, so renderers can show every candidate and why it failed
        self.levers = tuple(levers)  # the suggestions as typed records (planner.notes.Lever)

    def __str__(self) -> str:
        lines = [self.message] + [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)
