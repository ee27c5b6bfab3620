"""spec: Hugging Face fields checked with a did-you-mean, target errors, overrides named as arguments."""
import pytest

from ckplan import api
from ckplan.errors import SpecError, UsageError
from ckplan.spec import build_model, validate

pytest.importorskip("transformers")

INPUT = {"batch_size": 1, "shape": [4], "dtype": "int64", "high": 10}


def hf(fields):
    return validate({"model": {"hf": fields}, "input": INPUT})


def test_hf_field_typo_is_refused_with_did_you_mean():
    # transformers keeps unknown keywords silently: n_layers (for n_layer) built the default 12 layers.
    with pytest.raises(SpecError) as e:
        build_model(hf({"model_type": "gpt2", "n_layers": 2, "n_embd": 32, "n_head": 2}), "meta")
    assert e.value.exit_code == 2
    assert "model.hf.n_layers" in str(e.value) and "did you mean 'n_layer'" in str(e.value)
    # ... while real fields and their aliases (hidden_size, num_hidden_layers: attribute_map) build.
    m = build_model(hf({"model_type": "gpt2", "num_hidden_layers": 2, "hidden_size": 32, "n_head": 2,
                        "vocab_size": 50, "use_cache": False}), "meta")
    assert len(m.transformer.h) == 2


def test_hf_unknown_model_type_is_one_line():
    with pytest.raises(SpecError) as e:
        build_model(hf({"model_type": "gtp2"}), "meta")
    text = str(e.value)
    assert "\n" not in text and len(text) < 300 and "'gpt2'" in text


def test_hf_nonsense_model_type_is_one_line():
    with pytest.raises(SpecError) as e:
        build_model(hf({"model_type": "zzqqxx"}), "meta")
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_target_errors(tmp_path, monkeypatch):
    (tmp_path / "factories.py").write_text(
        "def not_a_module():\n    return 42\n"
        "def needs_width(width):\n    import torch\n    return torch.nn.Linear(width, width)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def spec(target, args=None):
        return validate({"model": {"target": target, "args": args or {}}, "input": {"batch_size": 1, "shape": [4]}})

    with pytest.raises(SpecError, match="run only specs you trust"):
        build_model(spec("factories:not_a_module"), "meta")
    with pytest.raises(SpecError, match="rejected args"):
        build_model(spec("factories:needs_width", {"height": 3}), "meta")
    with pytest.raises(SpecError, match="has no attribute 'nope'"):
        build_model(spec("factories:nope"), "meta")
    with pytest.raises(SpecError, match="must look like"):
        spec("factories.nope")


def test_spec_module_says_a_spec_is_code():
    import ckplan.spec
    assert "run only specs you trust" in ckplan.spec.__doc__.replace("\n", " ").lower()


@pytest.mark.parametrize("kw,needle", [
    ({"precision": "int8"}, "precision='int8'"), ({"accum": 0}, "accum=0"), ({"batch_size": -1}, "batch_size=-1"),
    ({"seq_len": 2.5}, "seq_len=2.5"), ({"optimizer": "lion"}, "optimizer='lion'"),
])
def test_overrides_are_named_as_arguments(write_spec, tmp_path, kw, needle):
    path = write_spec(tmp_path, "model: {builtin: mlp}\ninput: {batch_size: 2, shape: [4]}")
    with pytest.raises(UsageError) as e:
        api.load(path, **kw)
    assert needle in str(e.value) and "--" not in str(e.value)


def test_overrides_apply_and_unknown_keywords_are_named(write_spec, tmp_path):
    path = write_spec(tmp_path, "model: {builtin: gpt}\ninput: {batch_size: 2, shape: [16], dtype: int64, "
                                "high: 97, labels: {shape: [16], dtype: int64, high: 97}}")
    s = api.load(path, batch_size=3, seq_len=8, precision="bf16", optimizer="adam", accum=2)
    assert (s.input.batch_size, s.input.shape, s.input.labels.shape) == (3, [8], [8])
    assert (s.train.precision, s.train.optimizer, s.train.accum) == ("bf16", "adamw", 2)
    with pytest.raises(UsageError, match="batchsize"):
        api.load(path, batchsize=4)


def test_hf_config_properties_and_image_classification_build():
    # num_labels is a settable property of every config (it fills id2label), not a field.
    spec = validate({"model": {"hf": {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "intermediate_size": 64,
                                      "image_size": 32, "patch_size": 8, "num_labels": 7},
                               "task": "image-classification"},
                     "input": {"batch_size": 1, "shape": [3, 32, 32], "dtype": "float32",
                               "name": "pixel_values", "labels": {"shape": [], "high": 7}}})
    m = build_model(spec, "meta")
    assert type(m).__name__ == "ViTForImageClassification" and m.classifier.out_features == 7


def test_hf_task_with_several_classes_builds_the_first():
    # DeiT maps image-classification to two classes (with and without the teacher head).
    spec = validate({"model": {"hf": {"model_type": "deit", "hidden_size": 32, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "intermediate_size": 64,
                                      "image_size": 32, "patch_size": 8},
                               "task": "image-classification"},
                     "input": {"batch_size": 1, "shape": [3, 32, 32], "dtype": "float32",
                               "name": "pixel_values", "labels": {"shape": [], "high": 2}}})
    assert type(build_model(spec, "meta")).__name__ == "DeiTForImageClassification"
