"""A row's step that fails: out of memory, or an error the row reports while the bench goes on."""
from __future__ import annotations

import gc

import torch

from ..bench_records import ERROR, OK, OOM
from ..errors import ModelRunError, PlanRunError, first_line
from ..measure import TrackerLimitExceeded
from .entry import Entry
from .steps import Run


def guarded(run: Run, e: Entry, fn, *args) -> None:
    """Run ``fn(run, e, *args)``; an out-of-memory marks the strategy OOM and the bench goes on."""
    if e.status != OK:
        return
    try:
        fn(run, e, *args)
    except (torch.cuda.OutOfMemoryError, TrackerLimitExceeded) as err:
        e.status, e.message = OOM, first_line(str(err))[:200]
        run.opt.zero_grad(set_to_none=True)
        gc.collect()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    except PlanRunError as err:
        e.status, e.message = ERROR, plan_error(err)
        run.opt.zero_grad(set_to_none=True)
    except ModelRunError:
        raise
    except RuntimeError as err:
        e.status, e.message = ERROR, row_error(err)
        run.opt.zero_grad(set_to_none=True)


INPLACE_TIP = ("a checkpoint starts at a layer that changes its input in place (ReLU(inplace=True) "
               "and the like: PyTorch's checkpoint saves that input and cannot recompute from it); "
               "build those layers with inplace=False, or bench a plan (--plan) whose checkpoints "
               "start elsewhere")


SAC_MUTATED_TIP = ("torch's selective checkpointing cannot run this model: an op changes in place a "
                   "tensor the policy keeps (ReLU(inplace=True), x.add_(...) and the like); build those "
                   "layers with inplace=False to compare against it")


def plan_error(err: PlanRunError) -> str:
    """One line for a row whose plan cannot run on this model: the reason and its fix."""
    return str(err)


def row_error(err: RuntimeError) -> str:
    """One line for a row whose step raised: what PyTorch said, and the fix when it is known."""
    first = first_line(str(err))[:200]
    if "modified by an inplace operation" in str(err):
        return f"{INPLACE_TIP} ({type(err).__name__}: {first})"
    if "selective activation checkpoint has been mutated" in str(err):
        return f"{SAC_MUTATED_TIP} ({type(err).__name__}: {first})"
    return f"{type(err).__name__}: {first}"


def one_line(err: BaseException) -> str:
    """``Type: first line`` of an error; a wrapped one (Dynamo's ``BackendCompilerFailed``) by its cause."""
    root = err
    for _ in range(8):  # a chain of causes, bounded
        inner = root.__cause__ or getattr(root, "inner_exception", None)
        if not isinstance(inner, BaseException):
            break
        root = inner
    text = str(root).strip().splitlines()
    where = f"{type(err).__name__} from " if root is not err else ""
    return f"{where}{type(root).__name__}: {text[0][:200] if text else ''}"
