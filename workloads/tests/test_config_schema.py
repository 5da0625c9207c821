"""The workload configs' pydantic models (mflow_workloads.config) against the JSON Schemas that the
Rust side generates from the types of the configs it writes (workloads/schemas/train,
evaluate, verify_export .schema.json).

- The same properties, required keys, types and bounds, key by key.
- Sample configs are valid for both or for neither: a valid config of each stage and variations
  that stay valid (a bound reached, another allowed value, null where allowed), and variations
  that must be refused (a key missing, a key the model does not name, a value of another type,
  out of bounds, not among the allowed values). A refused sample's ConfigError names the key.
  Integral floats (1.0) for integer keys are not sampled: JSON Schema counts them as integers,
  the models (strict) do not, and mflow writes integers.
The samples are also held to the models' own JSON Schema (pydantic's), which needs no Rust build:
that checks the samples and the schema reader below every time.

The schema reader covers the keywords such schemas use and fails on any other, so that no
constraint of a schema goes unchecked.
"""

import copy
import math
import os
import re

import pytest

from conftest import WORKLOADS, read_json
from mflow_workloads import config as CFG
from mflow_workloads.errors import ConfigError

SCHEMAS = os.path.join(WORKLOADS, "schemas")
MODELS = {"train": CFG.TrainConfig, "evaluate": CFG.EvaluateConfig, "verify_export": CFG.VerifyExportConfig}
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "format", "deprecated"}
ANNOTATIONS |= {"readOnly", "writeOnly", "$defs", "definitions"}


# -- a JSON Schema reader for the keywords these schemas use


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), f"only local references are read: {ref}"
        target = root
        for part in ref[2:].split("/"):
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _json_type(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    if isinstance(value, dict):
        return {"object"}
    raise AssertionError(f"not a JSON value: {value!r}")


def errors(schema, value, root=None) -> list[str]:
    """Why `value` is not valid for `schema` (empty when it is)."""
    root = root if root is not None else schema
    if schema is True:
        return []
    if schema is False:
        return ["no value is allowed"]
    schema = _resolve(schema, root)
    out = []
    for key, want in schema.items():
        if key in ANNOTATIONS:
            continue
        if key == "type":
            types = {want} if isinstance(want, str) else set(want)
            if not types & _json_type(value):
                out.append(f"{value!r} is not of type {sorted(types)}")
        elif key == "enum":
            if not any(value == w and _json_type(value) & _json_type(w) for w in want):
                out.append(f"{value!r} is not one of {want}")
        elif key == "const":
            if not (value == want and _json_type(value) & _json_type(want)):
                out.append(f"{value!r} is not {want!r}")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                ok = {"minimum": value >= want, "maximum": value <= want}.get(key)
                ok = ok if ok is not None else (value > want if key == "exclusiveMinimum" else value < want)
                if not ok:
                    out.append(f"{value!r} is out of bounds ({key} {want})")
        elif key in ("minItems", "maxItems", "minLength", "maxLength"):
            sized = isinstance(value, list if key.endswith("Items") else str)
            if sized and ((len(value) < want) if key.startswith("min") else (len(value) > want)):
                out.append(f"{value!r} breaks {key} {want}")
        elif key == "items":
            if isinstance(value, list):
                out += [e for item in value for e in errors(want, item, root)]
        elif key == "properties":
            if isinstance(value, dict):
                out += [f"{k}: {e}" for k, sub in want.items() if k in value for e in errors(sub, value[k], root)]
        elif key == "required":
            if isinstance(value, dict):
                out += [f"missing key {k!r}" for k in want if k not in value]
        elif key == "additionalProperties":
            if isinstance(value, dict):
                named = set(schema.get("properties", {}))
                out += [f"{k}: {e}" for k, v in value.items() if k not in named for e in errors(want, v, root)]
        elif key == "anyOf":
            if all(errors(alt, value, root) for alt in want):
                out.append(f"{value!r} matches none of anyOf")
        elif key == "oneOf":
            if sum(not errors(alt, value, root) for alt in want) != 1:
                out.append(f"{value!r} does not match exactly one of oneOf")
        elif key == "allOf":
            out += [e for alt in want for e in errors(alt, value, root)]
        else:
            raise AssertionError(f"the schema uses {key!r}, which this reader does not check")
    return out


def describe(schema, root) -> dict:
    """A property's types, allowed values and bounds in one form, whichever way a schema
    spells them (type lists or anyOf with null, enum or const, exclusive integer bounds)."""
    schema = _resolve(schema, root)
    out = {"types": set(), "enum": None, "min": None, "max": None, "min_items": None, "items": None}
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        for alt in (describe(a, root) for a in alternatives):
            out["types"] |= alt["types"]
            if alt["enum"] is not None:
                out["enum"] = (out["enum"] or set()) | alt["enum"]
            for k in ("min", "max", "min_items", "items"):
                out[k] = out[k] if alt[k] is None else alt[k]
        return out
    t = schema.get("type")
    out["types"] = set() if t is None else {t} if isinstance(t, str) else set(t)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        out["enum"] = {v for v in values if v is not None}
        out["types"] |= {"null"} if None in values else set()
        out["types"] |= {"string"} if any(isinstance(v, str) for v in values) else set()
    integer = out["types"] & {"integer"}
    if "minimum" in schema:
        out["min"] = schema["minimum"]
    if "exclusiveMinimum" in schema:
        out["min"] = schema["exclusiveMinimum"] + 1 if integer else ("exclusive", schema["exclusiveMinimum"])
    if "maximum" in schema:
        out["max"] = schema["maximum"]
    if "exclusiveMaximum" in schema:
        out["max"] = schema["exclusiveMaximum"] - 1 if integer else ("exclusive", schema["exclusiveMaximum"])
    out["min_items"] = schema.get("minItems") or None
    if "items" in schema:
        out["items"] = describe(schema["items"], root)
    return out


# -- samples


def base_config(stage: str, tmp_path) -> dict:
    d = str(tmp_path)
    if stage == "train":
        return {
            "stage": "train",
            "engine": "reference",
            "shards": d,
            "data": d,
            "output": d + "/out",
            "scratch": d + "/scratch",
            "tp": 2,
            "pp": 1,
            "dp": 1,
            "iterations": 20,
            "seq_length": 64,
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_iterations": 5,
            "lr_decay": "cosine",
            "weight_decay": 0.1,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
            "seed": 1234,
            "precision": "fp32",
            "save_interval": 10,
            "log_interval": 1,
            "eval_interval": 10,
            "eval_iters": 2,
            "attention": "sdpa",
        }
    if stage == "evaluate":
        return {
            "stage": "evaluate",
            "engine": "reference",
            "shards": d,
            "data": d,
            "output": d + "/out",
            "tp": 1,
            "pp": 1,
            "seq_length": 64,
            "micro_batch_size": 4,
            "eval_iters": 2,
            "splits": ["valid", "test"],
            "baseline": None,
            "prompts": ["The"],
            "max_new_tokens": 8,
            "precision": "fp32",
        }
    return {
        "stage": "verify_export",
        "hf": d,
        "shards": d,
        "prompts": ["The"],
        "max_new_tokens": 16,
        "output": d + "/out",
    }


def variations(base: dict, schema: dict) -> tuple[list, list]:
    """(samples that stay valid, samples that must be refused) of `base`, from what `schema`
    says of each key; each as (what changed, key, config)."""
    valid, refused = [("as mflow writes it", None, base)], [("with a key no model names", "env", {**base, "env": {}})]

    def variant(key, value):
        return {**copy.deepcopy(base), key: value}

    for key, prop in schema["properties"].items():
        d = describe(prop, schema)
        if key in schema.get("required", []):
            refused.append(("missing", key, {k: v for k, v in base.items() if k != key}))
        types = d["types"]
        for wrong in ("text", 1.5, True, [], {}, None):
            if not types & _json_type(wrong) and not (d["enum"] is not None and isinstance(wrong, str)):
                refused.append((f"{wrong!r}", key, variant(key, wrong)))
        if "null" in types:
            valid.append(("null", key, variant(key, None)))
        if d["enum"] is not None and key != "stage":
            valid += [(f"{v!r}", key, variant(key, v)) for v in sorted(d["enum"])]
            refused.append(("'bogus'", key, variant(key, "bogus")))
        if isinstance(d["min"], (int, float)):
            step = 1 if "integer" in types else 0.5
            valid.append((f"minimum {d['min']}", key, variant(key, d["min"])))
            refused.append((f"below its minimum {d['min']}", key, variant(key, d["min"] - step)))
        if types == {"number"} and isinstance(base[key], float) and math.isfinite(base[key]):
            valid.append(("an integer", key, variant(key, int(base[key]) + 1)))
        if d["items"] is not None:
            item = d["items"]
            if item["enum"] is not None:
                valid += [(f"[{v!r}]", key, variant(key, [v])) for v in sorted(item["enum"])]
                refused.append(("['bogus']", key, variant(key, ["bogus"])))
            refused.append(("[1]", key, variant(key, [1])))
            if d["min_items"]:
                refused.append(("[]", key, variant(key, [])))
            else:
                valid.append(("[]", key, variant(key, [])))
    return valid, refused


def rust_schema(stage: str) -> dict:
    path = os.path.join(SCHEMAS, f"{stage}.schema.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist (yet): the Rust side generates it from the config types it writes")
    return read_json(path)


def model_accepts(stage: str, config: dict) -> bool:
    try:
        MODELS[stage].model_validate(config)
    except ValueError:
        return False
    return True


def _check_samples(stage: str, schema: dict, tmp_path) -> None:
    base = base_config(stage, tmp_path)
    assert not errors(schema, base), errors(schema, base)
    CFG.parse(MODELS[stage], f"{stage}.json", base)  # the after-checks hold too
    valid, refused = variations(base, schema)
    assert len(refused) > 2 * len(schema["properties"]), "too few samples to mean anything"
    for what, key, config in valid:
        assert not errors(schema, config), (stage, key, what, errors(schema, config))
        assert model_accepts(stage, config), (stage, key, what)
    for what, key, config in refused:
        assert errors(schema, config), (stage, key, what, "the schema accepts it")
        assert not model_accepts(stage, config), (stage, key, what, "the model accepts it")
        with pytest.raises(ConfigError, match=f"'{key}"):
            CFG.parse(MODELS[stage], f"{stage}.json", config)


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_samples_against_the_models_own_schema(stage, tmp_path):
    _check_samples(stage, MODELS[stage].model_json_schema(), tmp_path)


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_samples_against_the_rust_schema(stage, tmp_path):
    _check_samples(stage, rust_schema(stage), tmp_path)


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_models_say_what_the_rust_schemas_say(stage):
    theirs = rust_schema(stage)
    ours = MODELS[stage].model_json_schema()
    assert _resolve(theirs, theirs).get("type") == "object"
    assert set(theirs["properties"]) == set(ours["properties"])
    assert set(theirs.get("required", [])) == set(ours["required"])
    for key in ours["properties"]:
        assert describe(theirs["properties"][key], theirs) == describe(ours["properties"][key], ours), key


RULES = [
    ("train", {"tp": 0}, "key 'tp' must be a positive integer, got 0", "set 'tp' to a whole number >= 1"),
    ("train", {"pp": True}, "key 'pp' must be a positive integer, got True", "whole number >= 1"),
    ("train", {"lr": "0.1"}, "key 'lr' must be a non-negative number, got '0.1'", "such as the defaults"),
    ("train", {"warmup_iterations": -1}, "key 'warmup_iterations' must be an integer >= 0", "use 0 for no warmup"),
    ("train", {"engine": "tpu"}, "key 'engine' is 'tpu'", "'reference' or 'megatron'"),
    ("train", {"stage": "evaluate"}, "key 'stage' is 'evaluate', expected 'train'", "only with a train config"),
    ("train", {"min_lr": 1}, "min_lr 1.0 exceeds lr 0.003", "lower min_lr"),
    (
        "train",
        {"global_batch_size": 6},
        "global_batch_size 6 is not a multiple of micro_batch_size\\*dp = 4\\*1",
        "micro_batch_size \\* dp \\* k",
    ),
    ("train", {"shards": "shards"}, "key 'shards' must be an absolute path, got 'shards'", "absolute directories"),
    ("train", {"data": "/no/such/dir"}, "directory 'data' = /no/such/dir does not exist", "upstream stage"),
    ("train", {"tp": 0, "lr_decay": "step"}, "2 problems:\n  key 'tp' .*\n  key 'lr_decay' is 'step'", "each problem"),
    ("evaluate", {"splits": ["dev"]}, "key 'splits\\[\\]' is 'dev'", "'valid' or 'test'"),
    ("evaluate", {"prompts": [1]}, "key 'prompts' must be a list of strings, got \\[1\\]", "quote each prompt"),
    ("evaluate", {"max_new_tokens": -1}, "key 'max_new_tokens' must be an integer >= 0", "use 0 to skip"),
    ("evaluate", {"baseline": "/no/such/dir"}, "directory 'baseline' = /no/such/dir does not exist", "upstream"),
    ("verify_export", {"prompts": []}, "key 'prompts' must be a non-empty list of strings", "at least one prompt"),
    ("verify_export", {"max_new_tokens": 0}, "key 'max_new_tokens' must be an integer >= 1", "use e.g. 16"),
]


@pytest.mark.parametrize(("stage", "change", "message", "help"), RULES, ids=[f"{r[0]}-{'-'.join(r[1])}" for r in RULES])
def test_each_rule_is_refused_with_its_key_and_what_to_do(stage, change, message, help, tmp_path):
    """Today's words: the file, the key, what it must hold, and what to do."""
    config = {**base_config(stage, tmp_path), **change}
    with pytest.raises(ConfigError, match=f"^config {stage}.json: {message}") as e:
        CFG.parse(MODELS[stage], f"{stage}.json", config)
    assert e.value.help and re.search(help, e.value.help), e.value.help
