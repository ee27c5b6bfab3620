"""spec: Hugging Face fields checked with a did-you-mean, target errors, overrides named as arguments."""
import re

import pytest

from ckplan import api
from ckplan.errors import SpecError, UsageError
from ckplan.spec import build_model, check_optimizer, check_overrides, check_precision, validate

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


def test_hf_keywords_a_config_reads_from_its_kwargs_are_fields():
    """A config whose ``__post_init__`` pops a keyword out of ``**kwargs`` by name takes it."""
    from ckplan.spec.hf import hf_config_fields

    class Config:
        def __init__(self, width=4, **kwargs):
            self.width = width
            self.depth = kwargs.pop("depth", 2)
            self.heads = kwargs.get('heads')

    assert {"width", "depth", "heads"} <= hf_config_fields(Config)
    assert "kwargs" not in hf_config_fields(Config)


def test_hf_fields_the_config_or_the_model_reads_by_name_are_taken():
    # Hub configs carry them: GPT-NeoX's rotary_pct (transformers 5 pops it where it builds the
    # rope parameters), DeBERTa-v2's position_buckets (read with getattr by the model only).
    pytest.importorskip("transformers")
    neox = build_model(hf({"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 50,
                           "rotary_pct": 0.25, "use_cache": False}), "meta")
    assert neox.gpt_neox.rotary_emb.inv_freq.numel() == 16 // 4 // 2  # head 16, a quarter rotated
    deb = build_model(hf({"model_type": "deberta-v2", "hidden_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 50,
                          "relative_attention": True, "position_buckets": 8, "max_relative_positions": -1}),
                      "meta")
    assert deb.deberta.encoder.rel_embeddings.weight.shape[0] == 2 * 8
    with pytest.raises(SpecError, match="did you mean 'position_buckets'"):
        build_model(hf({"model_type": "deberta-v2", "position_bucket": 8}), "meta")


def test_hf_default_padding_id_outside_a_small_vocabulary_names_the_field():
    # Phi-3's config defaults pad_token_id to 32000; with vocab_size 512 the model's embedding
    # asserts inside transformers. ckplan names the field, the value, the limit and the fix.
    pytest.importorskip("transformers")
    fields = {"model_type": "phi3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "use_cache": False}
    with pytest.raises(SpecError) as e:
        build_model(hf(fields), "meta")
    assert e.value.exit_code == 2
    assert "pad_token_id" in str(e.value) and "32000" in str(e.value) and "vocab_size 512" in str(e.value)
    assert "below 512" in (e.value.tip or "")
    m = build_model(hf({**fields, "pad_token_id": 0}), "meta")  # the fix the message gives builds
    assert m.get_input_embeddings().padding_idx == 0


def test_hf_unknown_model_type_is_one_line():
    with pytest.raises(SpecError) as e:
        build_model(hf({"model_type": "gtp2"}), "meta")
    text = str(e.value)
    assert "\n" not in text and len(text) < 300 and "'gpt2'" in text


def test_hf_attn_implementation_is_passed_to_the_model_and_checked():
    # A config field transformers takes beside the config (from_config's), not one of its fields.
    gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50, "use_cache": False}
    assert build_model(hf({**gpt2, "attn_implementation": "eager"}), "meta").config._attn_implementation == "eager"
    assert build_model(hf(gpt2), "meta").config._attn_implementation == "sdpa"
    with pytest.raises(SpecError) as e:
        build_model(hf({**gpt2, "attn_implementation": "fastest"}), "meta")
    assert e.value.exit_code == 2 and "model.hf.attn_implementation 'fastest'" in str(e.value)


def test_hf_task_the_model_type_lacks_names_the_tasks_it_has():
    # Whisper has no AutoModelForSeq2SeqLM class (it is speech-to-text): one line, exit 2, the tasks it has.
    spec = validate({"model": {"hf": {"model_type": "whisper", "d_model": 32, "encoder_layers": 1,
                                      "decoder_layers": 1}, "task": "seq2seq-lm"}, "input": INPUT})
    with pytest.raises(SpecError) as e:
        build_model(spec, "meta")
    assert e.value.exit_code == 2 and "model.task 'seq2seq-lm'" in str(e.value) and "'whisper'" in str(e.value)
    assert "causal-lm" in (e.value.tip or "") and "seq2seq-lm" not in (e.value.tip or "")


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
    with pytest.raises(SpecError, match="has no attribute 'Needs_width'") as e:  # the case a user gets wrong
        build_model(spec("factories:Needs_width"), "meta")
    assert e.value.tip == "did you mean 'needs_width'?"
    with pytest.raises(SpecError, match="must look like"):
        spec("factories.nope")
    (tmp_path / "broken_factory.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(SpecError, match="'broken_factory:make': importing module 'broken_factory' raised "
                                        "RuntimeError: boom at import") as e:
        build_model(spec("broken_factory:make"), "meta")
    assert "import broken_factory" in e.value.tip
    with pytest.raises(SpecError, match="cannot import module 'no_such_module_here'"):
        build_model(spec("no_such_module_here:make"), "meta")


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


# ---- what the model or the machine cannot take is refused before anything is allocated ---------

@pytest.mark.parametrize("model,seq,needle", [
    ({"builtin": "gpt", "args": {"block_size": 64, "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 10}},
     65, "above the 64 positions the model takes (model.args.block_size)"),
    ({"builtin": "gpt", "args": {"pos": "rope", "block_size": 64, "n_layer": 1, "n_embd": 16, "n_head": 2,
                                 "vocab_size": 10}}, 150_000_000, "is 150000000, above the 64 positions"),
    ({"builtin": "bert", "args": {"n_layer": 1, "d_model": 16, "n_head": 2, "d_ff": 32, "vocab_size": 10}},
     513, "above the 512 positions the model takes (model.args.max_position, the default of builtin 'bert')"),
    ({"hf": {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32, "vocab_size": 10}},
     33, "above the 32 positions the model takes (the position table transformer.wpe has 32 rows)"),
    ({"hf": {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
             "intermediate_size": 32, "max_position_embeddings": 24, "vocab_size": 10}},
     25, "the position table bert.embeddings.position_embeddings has 24 rows"),
])
def test_a_sequence_longer_than_the_model_takes_is_refused(model, seq, needle):
    spec = validate({"model": model, "input": {**INPUT, "shape": [8]}}).with_overrides(seq_len=seq)
    with pytest.raises(SpecError, match=re.escape(needle)) as e:
        build_model(spec, "meta")
    assert "seq_len" in e.value.tip
    ok = validate({"model": model, "input": {**INPUT, "shape": [8]}})
    assert build_model(ok, "meta") is not None  # within the limit: built


def test_a_rotary_hf_model_takes_sequences_past_max_position_embeddings():
    spec = validate({"model": {"hf": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16,
                                      "num_attention_heads": 2, "intermediate_size": 32,
                                      "max_position_embeddings": 8, "vocab_size": 10}},
                     "input": {**INPUT, "shape": [16], "name": "input_ids"}})
    assert build_model(spec, "meta") is not None  # no learned table: no bound


@pytest.mark.parametrize("over,needle", [
    ({"batch_size": 10**20}, "with the override batch_size=100000000000000000000: input: the input (batch_size "
                             "100000000000000000000 x shape [4], int64) would take about 3.2e+21 bytes, larger "
                             "than any machine's memory"),
    ({"seq_len": 2**62}, "larger than any machine's memory"),
])
def test_a_batch_no_machine_holds_is_a_spec_error(over, needle):
    spec = validate({"model": {"builtin": "mlp"}, "input": INPUT})
    with pytest.raises(SpecError, match=re.escape(needle)):
        spec.with_overrides(**over)


def test_input_shape_needs_a_dimension():
    with pytest.raises(SpecError, match=re.escape("input.shape: shape is [], but it must list at least one "
                                                  "dimension")):
        validate({"model": {"builtin": "mlp"}, "input": {**INPUT, "shape": []}})


@pytest.mark.parametrize("inp,needle,tip", [
    ({**INPUT, "batch_size": -3}, "input.batch_size: Input should be greater than 0 (got -3)", None),
    ({**INPUT, "dtype": "int8"}, "Input should be 'float32', 'float16', 'bfloat16', 'float64', 'int64' or "
                                 "'int32' (got 'int8')", None),
    ({**INPUT, "shape": ["abc"]}, "input.shape.0: Input should be a valid integer, unable to parse string as an "
                                  "integer (got 'abc')", None),
    ({"batchsize": 1, "shape": [4], "dtype": "int64", "high": 10}, "input.batchsize: unknown key",
     "did you mean 'batch_size'?"),
    ({**INPUT, "colour": "red"}, "input.colour: unknown key", "the keys of `input` are batch_size, shape"),
])
def test_spec_errors_show_the_value_and_a_fix(inp, needle, tip):
    with pytest.raises(SpecError) as e:
        validate({"model": {"builtin": "mlp"}, "input": inp})
    assert needle in e.value.message
    assert "README" not in str(e.value)
    if tip:
        assert tip in e.value.tip


def test_precision_and_optimizer_are_checked_in_one_place():
    assert check_precision("bf16") == "bf16" and check_optimizer("adam") == "adamw"
    for call in (lambda: check_precision("int8"), lambda: check_overrides(precision="int8")):
        with pytest.raises(UsageError, match=r"precision='int8' is not one of fp32, bf16, fp16"):
            call()
    for call in (lambda: check_optimizer("lion"), lambda: check_overrides(optimizer="lion")):
        with pytest.raises(UsageError, match=r"optimizer='lion' is not one of adamw, sgd-momentum, sgd"):
            call()


def test_a_meta_build_is_the_cpu_build_without_values(tmp_path):
    """Building on meta skips value initialisation only: every parameter and buffer has the CPU
    build's name, shape, dtype and requires_grad (the rotary tables computed at init included)."""
    import torch

    from ckplan.spec import build_model
    p = tmp_path / "llama.yaml"
    p.write_text("model:\n  builtin: gpt\n  args: {vocab_size: 64, block_size: 32, n_layer: 2, n_head: 2, n_embd: 32,"
                 " norm: rmsnorm, mlp: swiglu, pos: rope, bias: false}\n"
                 "input: {batch_size: 1, shape: [16], dtype: int64, high: 64}\nchain: blocks\n")
    spec = api.load(p)

    def described(m):
        return ([(n, t.shape, t.dtype, t.requires_grad) for n, t in m.named_parameters()]
                + [(n, t.shape, t.dtype) for n, t in m.named_buffers()])
    meta, cpu = build_model(spec, "meta"), build_model(spec, "cpu")
    assert described(meta) == described(cpu)
    assert all(t.is_meta for t in meta.parameters())
    w = torch.empty(4, 4)
    torch.nn.init.normal_(w)  # outside a meta build, initialisation runs as ever
    assert w.std() > 0


def test_float_input_to_a_model_that_embeds_token_ids_is_a_spec_error():
    # One spec error naming the dtype, not torch's "Expected tensor for argument #1 'indices'".
    gpt = {"builtin": "gpt", "args": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100, "block_size": 16}}
    spec = validate({"model": gpt, "input": {"batch_size": 1, "shape": [8], "dtype": "float32"}})
    with pytest.raises(SpecError) as e:
        build_model(spec, "meta")
    assert e.value.exit_code == 2 and "input.dtype 'float32'" in str(e.value) and "int64" in (e.value.tip or "")
    hfspec = validate({"model": {"hf": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}},
                       "input": {"batch_size": 1, "shape": [8], "dtype": "bfloat16", "name": "input_ids"}})
    with pytest.raises(SpecError, match="must be integers"):
        build_model(hfspec, "meta")


def test_hf_whisper_features_of_the_wrong_shape_are_refused_before_running():
    pytest.importorskip("transformers")
    hf = {"model_type": "whisper", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
          "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
          "decoder_ffn_dim": 64, "num_mel_bins": 8, "max_source_positions": 20, "vocab_size": 64,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    spec = validate({"model": {"hf": hf, "task": "speech-seq2seq"},
                     "input": {"batch_size": 1, "shape": [8, 30], "dtype": "float32", "name": "input_features",
                               "labels": {"shape": [8], "high": 64}}})
    with pytest.raises(SpecError, match=r"input.shape \[8, 30\]: whisper takes .* = \[8, 40\]"):
        build_model(spec, "meta")
    good = validate({**spec.model_dump(), "input": {**spec.input.model_dump(), "shape": [8, 40]}})
    # the config's default decoder start (50257) is outside this vocabulary: said before building
    with pytest.raises(SpecError, match=r"decoder_start_token_id \(the whisper config's default\) 50257 "
                                        r"is outside the vocabulary \(vocab_size 64"):
        build_model(good, "meta")
    good.model.hf["decoder_start_token_id"] = 1
    assert type(build_model(good, "meta")).__name__ == "WhisperForConditionalGeneration"
