"""Chain detection (ckplan.chainfind): the container of repeated layers the model calls."""
import pytest
import torch.nn as nn

from ckplan.chainfind import resolve_chain
from ckplan.errors import SpecError


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _Funnel(nn.Module):
    """Funnel's layout: a list of lists of blocks (the outer list has no forward), and a
    shorter list of blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(_Block() for _ in range(3)) for _ in range(4))
        self.head = nn.ModuleList(_Block() for _ in range(2))


def test_detection_takes_the_longest_run_of_one_layer_class():
    m = nn.Module()
    m.short, m.body = nn.ModuleList(_Block() for _ in range(2)), nn.Sequential(*[_Block() for _ in range(5)])
    assert resolve_chain(m, None)[:1] == ("body",) and resolve_chain(m, None)[2]


def test_a_list_of_lists_is_not_a_chain():
    """Its entries are never called (a ModuleList has no forward): the model calls the blocks."""
    path, mod, detected = resolve_chain(_Funnel(), None)
    assert path in {f"blocks.{i}" for i in range(4)} and len(mod) == 3 and detected


def test_a_named_chain_is_checked():
    with pytest.raises(SpecError, match=r"no submodule 'blocks\.9'"):
        resolve_chain(_Funnel(), "blocks.9")
    assert resolve_chain(_Funnel(), "head")[1] is not None
