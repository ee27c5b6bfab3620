"""What a compiled step saves for backward, read from TorchInductor's partitioned graphs
(ckplan.measure.compiled_graph): the graph's sum against the bytes the allocator holds after the
forward, per chain layer where the layers ran with different checkpoint regions."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ckplan.bench.memory import profiled_step_memory
from ckplan.measure.compiled_graph import SavedForBackward, module_path
from ckplan.peers import compile_unavailable, eager_random_ops
from ckplan.sac import context_fn
from ckplan.zoo import build_builtin


@pytest.mark.parametrize("path,name", [
    ("L['self'].blocks[3]", "blocks.3"),
    ("L['self']._modules['blocks']._modules['3']", "blocks.3"),
    ("L['self'].transformer.h[11].attn", "transformer.h.11.attn"),
    ("L['self']._orig_mod.layers[0]", "layers.0"),
    ("L['fn'].encoder.layer[2]", "encoder.layer.2"),
    ("L['args'][0].model.layers.0.mlp", "model.layers.0.mlp"),  # a Hugging Face Llama, torch 2.13
])
def test_dynamo_module_paths_become_dotted_names(path, name):
    assert module_path(path) == name


@pytest.mark.slow  # a TorchInductor compile of a small GPT: about half a minute on 2 cores
@pytest.mark.skipif(bool(compile_unavailable("cpu")), reason="TorchInductor cannot compile on this machine")
def test_the_partitioned_graph_saves_what_the_step_holds_after_its_forward():
    torch.manual_seed(0)
    model = build_builtin("gpt", dict(vocab_size=128, block_size=64, n_layer=3, n_head=2, n_embd=64,
                                      dropout=0.0))
    ids = torch.randint(0, 128, (2, 64))
    layers = list(model.blocks)
    # layer 0 keeps its matmul outputs (a selective region), layer 1 recomputes everything, layer 2
    # is stored whole
    layers[0].forward = functools.partial(checkpoint, layers[0].forward, use_reentrant=False,
                                          context_fn=context_fn("sac-linear"))
    layers[1].forward = functools.partial(checkpoint, layers[1].forward, use_reentrant=False)
    saved = SavedForBackward([f"blocks.{i}" for i in range(3)])

    def backend(gm, example_inputs):  # as ckplan's compiled rows compile (random ops drawn as eager)
        from torch._inductor.compile_fx import compile_fx
        with saved, eager_random_ops():
            return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=backend)

    def step(after_forward, after_backward):
        loss = compiled(ids, labels=ids)
        after_forward()
        loss.backward()
        after_backward()

    step(lambda: None, lambda: None)  # compiles
    model.zero_grad(set_to_none=True)
    held = profiled_step_memory(step).after_forward
    assert abs(saved.activations() - held) <= 16, (saved.bytes, held)
    by = saved.bytes
    assert set(by) >= {"L0", "L1", "L2", "inputs", "other"}
    # recomputing everything saves less than keeping the matmuls, which saves less than storing
    assert 0 < by["L1"] < by["L0"] < by["L2"]
