"""Plan a small GPT and print the snippet that applies the plan in each framework.

    python examples/export_plan.py

Each export says whether it reproduces the plan exactly; when it does not, ``closest_plan`` is
what the snippet applies and ``message`` says what differs. ``ckplan.apply_plan(model, plan)``
applies any plan exactly in your own training loop.
"""
import torch

import ckplan
from ckplan.export import TARGETS
from ckplan.zoo.gpt import build_gpt

torch.manual_seed(0)
model = build_gpt(vocab_size=512, block_size=256, n_layer=12, n_head=4, n_embd=128)
ids = torch.randint(0, 512, (8, 256))
result = ckplan.plan_model(model, {"input_ids": ids, "labels": ids}, budget="60%", optimizer="sgd")
print("plan:", result.plan.describe())
for target in TARGETS:
    e = ckplan.export_plan(result.plan, target, chain_path="blocks", layer_class="Block", model_name="gpt")
    print(f"\n===== {target}: exact={e.exact}\n{e.text}{e.message}")
