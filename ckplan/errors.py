"""One error hierarchy for ckplan; each class carries its process exit code.

The CLI maps any :class:`CkplanError` to ``Error: <message>`` on stderr and ``exit_code``.
Messages name the value, the limit and the fix (a tip at the end), as PyTorch's
checkpoint errors do.

Exit codes (documented in README):

====  ==========================================================
0     success
1     a failure while running the model (:class:`ModelRunError`), a result file that could not
      be written (:class:`WriteError`: a full disk), or an unexpected error: the planner breaking one
      of its own invariants (:class:`PlannerBugError`), any exception not of this hierarchy
2     bad spec, bad option or bad file (:class:`SpecError`, :class:`UsageError`); a chain or an
      argument value the planner cannot take (:class:`ChainError`, :class:`PlannerArgumentError`)
3     the budget is below the smallest feasible peak (:class:`InfeasibleBudgetError`); bench:
      a row predicted to fit an explicit ``--budget`` measured above it (``over-budget``),
      after the table and the reports
4     a wrong result: bench found a plan that changed the gradients or made NaN/inf
      (:class:`WrongResultError`); the table and the reports are written first
130   interrupted (SIGINT, Ctrl-C); 143: terminated (SIGTERM) (:class:`Interrupted`, 128 + the
      signal, as a shell reports a process that a signal ended)
====  ==========================================================
"""
from __future__ import annotations


class CkplanError(Exception):
    """Base class. ``exit_code`` is what the CLI returns."""

    exit_code = 1

    def __init__(self, message: str, *, tip: str | None = None):
        self.message = message
        self.tip = tip
        super().__init__(message if tip is None else f"{message}. Tip: {tip}")


class UsageError(CkplanError):
    """A bad command-line value (a budget like ``12 parsecs``, an unknown strategy)."""

    exit_code = 2


class SpecError(CkplanError):
    """A missing or invalid model spec, plan or profile file."""

    exit_code = 2


class ChainError(SpecError, ValueError):
    """A chain the planner cannot take: a layer's sizes or times out of range, options or side
    inputs that do not fit its layers (``Chain(...)``, ``chain_from_profile``, ``plan_chain``).
    Also a ValueError, the exception Python code expects for a bad value."""


class PlannerArgumentError(UsageError, ValueError):
    """An argument value a planner function or table does not take (a ``mode`` it does not know, a
    ``trim`` outside [0, 1)). Also a ValueError."""


class DependencyError(CkplanError):
    """An optional dependency (an extra) is missing."""

    exit_code = 2


class ModelRunError(CkplanError):
    """The model failed while ckplan was running it (forward, backward, device)."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM in a command's process (the CLI turns it into this, as Python turns SIGINT into
    KeyboardInterrupt), so that what a Ctrl-C cleans up is cleaned up too; it exits 143."""

    signum = 15


class PlanRunError(ModelRunError):
    """A plan that cannot run on this model as planned (a checkpoint starting at a layer that
    changes its input in place): ``bench`` marks the row ``error`` and goes on."""


class PlannerBugError(CkplanError, RuntimeError):
    """The planner broke one of its own invariants (a plan over the budget it was solved for, a
    table with no step to reconstruct): a bug in ckplan, whatever the input. The tip asks for a
    report. Also a RuntimeError."""

    exit_code = 1

    def __init__(self, message: str, *, tip: str | None = None):
        super().__init__(message, tip=tip or "this is a bug in ckplan's planner; please report it with the "
                                             "command and the profile it read (--debug shows the traceback)")


class WriteError(CkplanError):
    """A result file could not be written (a full disk, a folder gone read-only during the run);
    the message names the file. Nothing half-written is left (ckplan.report.write_files)."""

    exit_code = 1


class InfeasibleBudgetError(CkplanError):
    """No plan fits the memory budget, even recomputing everything."""

    exit_code = 3

    def __init__(self, message: str, *, tip: str | None = None, budget_bytes: int = 0,
                 min_peak_bytes: int = 0, persistent_bytes: int = 0):
        super().__init__(message, tip=tip)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.persistent_bytes = persistent_bytes
        # How the budget was resolved ("--budget: the peak without checkpointing ... with 50% of its
        # activations ..."), set by ckplan.api.plan for the CLI's budget line; None where nobody set it.
        self.budget_source: str | None = None


class WrongResultError(CkplanError):
    """A result that must not be trusted: a plan changed the loss or gradients, or NaN/inf appeared."""

    exit_code = 4


class Interrupted(CkplanError):
    """A signal stopped a run after ckplan ended every process it had started (``bench --nproc``).

    ``exit_code`` is 128 + the signal: 130 for SIGINT, 143 for SIGTERM."""

    exit_code = 130

    def __init__(self, message: str, *, signum: int = 2, tip: str | None = None):
        super().__init__(message, tip=tip)
        self.signum = signum
        self.exit_code = 128 + signum


def first_line(text: str) -> str:
    """The first line of an exception's text, ``...`` marking the rest: PyTorch's C++ errors
    append a stack dump ("Exception raised from ... frame #0: ...") to their message."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] + (" ..." if len(lines) > 1 else "")
