"""Hugging Face models from a config built offline (``model.hf``), with random weights.

transformers is an optional dependency (the ``hf`` extra): it is imported only when a spec asks
for a Hugging Face model, and its absence is a DependencyError that names the extra.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import inspect
import re

from ..errors import DependencyError, SpecError, first_line
from .limits import check_speech_features, check_token_range
from .schema import InputSpec

_HF_TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "base": "AutoModel",
}
_HF_DEFAULT_TASK = {"bert": "masked-lm", "roberta": "masked-lm", "distilbert": "masked-lm",
                    "albert": "masked-lm", "deberta": "masked-lm", "deberta-v2": "masked-lm"}


def build_hf(fields: dict, task: str | None, inp: InputSpec | None = None):
    try:
        import transformers
    except ImportError:
        raise DependencyError("model.hf needs Hugging Face transformers, which is not installed",
                              tip="pip install 'ckplan[hf]'") from None
    fields = dict(fields)
    model_type = fields.pop("model_type")
    attn = fields.pop("attn_implementation", None)  # from_config's, not the config's: eager, sdpa, ...
    config_cls = _hf_config_class(transformers, model_type)
    _check_hf_fields(config_cls, model_type, fields)
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError) as e:
        raise SpecError(f"model.hf for model_type {model_type!r}: {e}".split("\n")[0]) from None
    if inp is not None and inp.name == "input_ids":  # only then is the input surely the token ids
        check_token_range(inp, getattr(config, "vocab_size", None),
                          "model.hf.vocab_size" if "vocab_size" in fields else
                          f"model.hf.vocab_size, the default of the {model_type} config")
    if inp is not None:
        check_speech_features(inp, config, model_type)
    task = task or _HF_DEFAULT_TASK.get(model_type, "causal-lm")
    if task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # T5's configs on the Hub say 0, its padding id; built from fields the config has none,
        # and the model needs it to shift the labels into decoder inputs.
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if pad is not None else 0
    if task in ("seq2seq-lm", "speech-seq2seq"):
        _check_start_token(config, model_type, fields)
    auto = getattr(transformers, _HF_TASKS[task])
    _check_task(transformers, auto, config, model_type, task)
    if attn is not None:
        try:
            return auto.from_config(config, attn_implementation=attn)
        except (ValueError, ImportError) as e:
            raise SpecError(f"model.hf.attn_implementation {attn!r} for model_type {model_type!r}: "
                            f"{first_line(str(e))}", tip="eager or sdpa (the default: sdpa where the model has it)"
                            ) from None
    try:  # a task with several classes (DeiT: with and without the teacher head) takes the first
        classes = auto._model_mapping[type(config)]
        if isinstance(classes, (tuple, list)) and not getattr(config, "architectures", None):
            config.architectures = [classes[0].__name__]
    except (KeyError, AttributeError):
        pass  # not a model of this task: from_config says so below
    try:
        try:
            return auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        except (ValueError, ImportError):
            # Architectures without SDPA attention (Bloom, GPT-J): transformers' own attention. A
            # failed attempt leaves "sdpa" set on the config it was given, hence the copy above.
            return auto.from_config(config, attn_implementation="eager")
    except AssertionError as e:
        if "padding_idx" in str(e).lower():
            _padding_id_error(config, model_type, fields)
        raise


def _check_task(transformers, auto, config, model_type: str, task: str) -> None:
    """A task the model type has no class for, said with the tasks it has."""
    try:
        if type(config) in auto._model_mapping:
            return
    except AttributeError:  # a transformers without the mapping: from_config says it
        return
    have = [t for t, name in _HF_TASKS.items()
            if type(config) in getattr(getattr(transformers, name, None), "_model_mapping", {})]
    raise SpecError(f"model.task {task!r}: transformers {transformers.__version__} has no {auto.__name__} "
                    f"class for model_type {model_type!r}",
                    tip=f"set model.task to one of {', '.join(have)}" if have else
                    "this model type has no task ckplan builds: give model.target (a function returning the model)")


def _check_start_token(config, model_type: str, fields: dict) -> None:
    """The labels shifted right start with ``decoder_start_token_id``: outside the vocabulary (a
    Whisper config's default 50257 with a small ``vocab_size``), the decoder's embedding fails at run time."""
    start, vocab = getattr(config, "decoder_start_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(start, int) and isinstance(vocab, int) and not 0 <= start < vocab:
        where = "model.hf.decoder_start_token_id" + ("" if "decoder_start_token_id" in fields else
                                                     f" (the {model_type} config's default)")
        raise SpecError(f"{where} {start} is outside the vocabulary (vocab_size {vocab}: 0 to {vocab - 1})",
                        tip=f"set decoder_start_token_id in model.hf to a token id below {vocab}")


def _padding_id_error(config, model_type: str, fields: dict) -> None:
    """The embedding's padding row outside the vocabulary: a config's default ``pad_token_id``
    (Phi-3: 32000) with a smaller ``vocab_size`` fails inside the model's constructor."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if not (isinstance(pad, int) and isinstance(vocab, int)):
        return
    where = "model.hf.pad_token_id" if "pad_token_id" in fields else \
        f"model.hf.pad_token_id (the {model_type} config's default)"
    raise SpecError(f"{where} {pad} is outside the vocabulary (vocab_size {vocab}: 0 to {vocab - 1})",
                    tip=f"set pad_token_id in model.hf to a token id below {vocab} (0 is usual), or null")


def _hf_config_class(transformers, model_type):
    mapping = transformers.CONFIG_MAPPING
    try:
        return mapping[model_type]
    except KeyError:
        close = difflib.get_close_matches(str(model_type), list(mapping.keys()), n=3, cutoff=0.7)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else \
            "use a model_type transformers knows, e.g. gpt2, bert, llama"
        raise SpecError(f"model.hf.model_type {model_type!r} is not a model type transformers "
                        f"{transformers.__version__} knows", tip=hint) from None


def hf_config_fields(config_cls) -> set[str]:
    """Every field name a Hugging Face config class takes: its signature, its defaults, its aliases."""
    known = set(getattr(config_cls, "attribute_map", {}) or {})
    for cls in config_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            known |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    # settable properties: PretrainedConfig's num_labels (which fills id2label), say
    known |= {n for cls in config_cls.__mro__ for n, v in vars(cls).items()
              if isinstance(v, property) and v.fset is not None and not n.startswith("_")}
    if dataclasses.is_dataclass(config_cls):
        known |= {f.name for f in dataclasses.fields(config_cls)}
    known |= _read_from_kwargs(config_cls) | _read_by_model(config_cls)
    try:
        default = config_cls()
        known |= set(default.to_dict())
        known |= {a for a in vars(default) if not a.startswith("_")}
    except Exception:  # a config that needs arguments: the signature above is what we have
        pass
    return known


def _read_from_kwargs(config_cls) -> set[str]:
    """Keywords a config class takes out of ``**kwargs`` by name anywhere in its source (Gemma 4's
    ``global_head_dim`` in ``__init__``, GPT-NeoX's ``rotary_pct`` where its rope parameters are
    built): ``kwargs.pop("name"`` or ``kwargs.get("name"``."""
    names: set[str] = set()
    for cls in config_cls.__mro__:
        if cls is object:
            continue
        try:
            src = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)[\"']", src))
    return names


def _read_by_model(config_cls) -> set[str]:
    """Attributes the model's own module reads from its config though the config class does not
    declare them (DeBERTa-v2's ``position_buckets``: ``getattr(config, "position_buckets", -1)``)."""
    module = config_cls.__module__.replace(".configuration_", ".modeling_")
    if module == config_cls.__module__:
        return set()
    try:
        src = inspect.getsource(importlib.import_module(module))
    except Exception:  # no modeling module of that name, or it does not import here
        return set()
    return set(re.findall(r"getattr\(\s*config\s*,\s*[\"'](\w+)[\"']", src))


# Read by the models from any config though no config class declares them (transformers 5).
HF_GENERIC_FIELDS = frozenset({"decoder_start_token_id", "pad_token_id", "bos_token_id", "eos_token_id",
                               "sep_token_id", "problem_type", "id2label", "label2id", "num_labels",
                               "tie_word_embeddings", "is_encoder_decoder"})


def _check_hf_fields(config_cls, model_type: str, fields: dict) -> None:
    # transformers keeps unknown keywords as attributes without a word, so `n_layers: 2` (a typo
    # for n_layer) would silently build the default 12 layers.
    known = hf_config_fields(config_cls) | HF_GENERIC_FIELDS
    for name in fields:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise SpecError(f"model.hf.{name}: {config_cls.__name__} ({model_type}) has no field {name!r}",
                            tip=f"did you mean {close[0]!r}?" if close else
                            f"see the fields of transformers.{config_cls.__name__}")
