"""Chain detection (ckplan.chainfind): the container of repeated layers the model calls."""
import pytest
import torch.nn as nn

from ckplan.chainfind import other_chains, resolve_chain
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


class _Stages(nn.Module):
    """torchvision's ResNet-18 layout: four stages of two blocks each, and a stage list above
    them (ConvNeXt's ``stages``) whose entries hold an inner list of experts-like blocks."""

    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential(*(nn.Sequential(_Block(), _Block()) for _ in range(4)))


def test_other_containers_are_named_in_a_note():
    m = _Stages()
    path, _, detected = resolve_chain(m, None)
    assert (path, detected) == ("stages", True)  # four of one class beats two
    note = other_chains(m, path)
    # stages.0 .. stages.3 are inside the chain's layers: not alternatives to it
    assert note is None
    inner = other_chains(m, "stages.0")
    assert inner == ("chain 'stages.0' was detected; other containers of repeated layers: stages (4 layers), "
                     "stages.1 (2 layers), stages.2 (2 layers), stages.3 (2 layers) (set `chain:` to plan one of them)")
    lone = nn.Module()
    lone.body = nn.Sequential(*[_Block() for _ in range(3)])
    assert other_chains(lone, "body") is None


class _RegStage(nn.Module):
    """timm's RegNet stage: blocks as attributes b1, b2, b3, called in order, in no container."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.b3 = _Block(), _Block(), _Block()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)  # leaves that repeat: not blocks

    def forward(self, x):
        return self.b3(self.b2(self.b1(x)))


def test_no_container_names_the_modules_whose_blocks_repeat():
    m = nn.Module()
    m.s1 = _RegStage()
    with pytest.raises(SpecError, match="found no ModuleList/Sequential") as e:
        resolve_chain(m, None)
    assert "not containers: s1 (3 x _Block)" in e.value.tip
