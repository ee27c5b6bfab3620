"""A model that takes no labels (timm, torchvision, plain classifiers) trains on the loss its own
loop would make: cross-entropy of its logits against the spec's labels, computed here by hand."""
import pytest
import torch
import torch.nn.functional as F

from ckplan import api
from ckplan.errors import ModelRunError
from ckplan.spec import build_model, make_batch, to_loss, validate
from ckplan.spec.labels import takes_labels


def _spec(target, shape, labels, dtype="float32", high=None, **args):
    inp = {"batch_size": 4, "shape": shape, "dtype": dtype, "labels": labels}
    if high is not None:
        inp["high"] = high
    return validate({"model": {"target": target, "args": args}, "input": inp,
                     "train": {"optimizer": "sgd"}})


def _loss_and_grads(model, args, kwargs):
    model.zero_grad(set_to_none=True)
    loss = to_loss(model(*args, **kwargs))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_class_labels_give_the_cross_entropy_of_the_logits():
    spec = _spec("ckmodels:PlainClassifier", [32], {"shape": [], "dtype": "int64", "high": 10})
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    loss, grads = _loss_and_grads(model, args, kwargs)
    # the same model called as its own loop would call it
    logits = torch.nn.Module.__call__(model, *args)  # hooks see no labels: the logits come back
    assert logits.shape == (4, 10)
    want = F.cross_entropy(logits, kwargs["labels"])
    assert torch.equal(loss, want.detach())
    model.zero_grad(set_to_none=True)
    want.backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_token_labels_give_the_cross_entropy_per_token():
    spec = _spec("ckmodels:PlainTokenModel", [16], "copy", dtype="int64", high=64)
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    loss, _ = _loss_and_grads(model, args, kwargs)
    logits = model(*args)  # no labels: logits
    assert loss == F.cross_entropy(logits.reshape(-1, 64), kwargs["labels"].reshape(-1))


def test_float_labels_of_the_outputs_shape_give_the_mean_squared_error():
    spec = _spec("ckmodels:PlainClassifier", [32], {"shape": [10], "dtype": "float32"})
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    loss, _ = _loss_and_grads(model, args, kwargs)
    assert loss == F.mse_loss(model(*args), kwargs["labels"])


def test_labels_that_fit_no_loss_are_one_clear_error():
    spec = _spec("ckmodels:PlainClassifier", [32], {"shape": [3], "dtype": "int64", "high": 10})
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    with pytest.raises(ModelRunError, match=r"input.labels of shape \[4, 3\] \(torch.int64\) fit neither "
                                            r".* output of shape \[4, 10\]") as e:
        model(*args, **kwargs)
    assert "input.labels shape [] with high: 10" in e.value.tip


class _WithLabels(torch.nn.Linear):
    def forward(self, x, labels=None):
        return super().forward(x)


class _WithKeywords(torch.nn.Linear):
    def forward(self, x, **kwargs):
        return super().forward(x)


def test_models_that_take_labels_are_left_alone():
    import ckmodels

    assert not takes_labels(ckmodels.PlainClassifier())
    assert takes_labels(_WithLabels(2, 2)) and takes_labels(_WithKeywords(2, 2))
    spec = _spec("ckmodels:PlainClassifier", [32], "none")
    model = build_model(spec, "cpu")
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_plain_classifier_benches_with_exact_peaks_and_gradients():
    spec = _spec("ckmodels:PlainClassifier", [32], {"shape": [], "dtype": "int64", "high": 10}, n_layers=6)
    res = api.bench(spec, strategies=["none", "every-k", "dp"], k=2, device="cpu", steps=1, warmup=0)
    for row in res.rows:
        assert row.status == "ok", row.message
        assert row.measured_peak_bytes == row.predicted_peak_bytes, row.strategy
        assert row.max_grad_diff == 0.0, row.strategy
    prof = api.profile(spec, device="meta")
    assert prof.chain == "blocks"
    assert prof.totals.predicted_peak_bytes == res.rows[0].predicted_peak_bytes


@pytest.mark.parametrize("accum", [1, 2])
def test_a_mean_squared_error_step_is_measured_as_a_plain_loop_runs_it(accum):
    # mse_loss on the CPU returns a scalar that keeps its (B, C) elementwise buffer alive with it.
    # A plain loop holds the loss through backward: the oracle is that loop under the tracker,
    # and bench's step must measure what it measures (and what the profile predicts); it measured
    # one buffer low when it divided the loss by accum, dropping the loss before backward.
    from ckplan.measure import LiveTensorTracker
    from ckplan.training import make_optimizer

    spec = _spec("ckmodels:PlainClassifier", [32], {"shape": [64], "dtype": "float32"}, n_layers=4, classes=64)
    spec = api.load(spec, batch_size=64, accum=accum)
    res = api.bench(spec, strategies=["none"], device="cpu", steps=1, warmup=0)
    row = res.rows[0]
    assert row.status == "ok", row.message
    assert row.measured_peak_bytes == row.predicted_peak_bytes, accum
    torch.manual_seed(0)
    model = build_model(spec, "cpu")
    (x,), kw = make_batch(spec, "cpu")
    opt = make_optimizer(list(model.parameters()), "sgd", 1e-4, "cpu")
    for _ in range(2):  # the second step: the optimizer's state and the allocator warm
        with LiveTensorTracker() as tr:
            for _ in range(accum):
                loss = F.mse_loss(model(x), kw["labels"])
                loss.backward()  # scaling by 1 / accum changes values, not bytes
            opt.step()
            opt.zero_grad(set_to_none=True)
    resident = sum(p.numel() * 4 for p in model.parameters()) + x.nbytes + kw["labels"].nbytes
    assert resident + tr.peak == res.rows[0].measured_peak_bytes
