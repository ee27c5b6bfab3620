"""ckplan: profile, plan and benchmark activation checkpointing for PyTorch training."""
from .errors import (CkplanError, InfeasibleBudgetError, ModelRunError, SpecError,  # noqa: F401
                     UsageError)

__version__ = "0.1.0"
