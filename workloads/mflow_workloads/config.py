"""The JSON configs mflow writes for each workload (src/stages/job.rs), checked key by key.

Each config is a pydantic model of its keys, their types and bounds: what the JSON Schemas of
workloads/schemas/ say, which the Rust side generates from its own types (a test holds the
models to them). A key the models do not name is refused, as the schemas refuse it. What a schema
cannot say is checked after: the paths are absolute and the input directories exist, min_lr <=
lr, and the global batch divides into micro-batches over dp. Every problem is a ConfigError that
names the file and the key, with what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Rule:
    """What a key must hold and what to do otherwise: the words of its ConfigError ({key} in
    `help` is the key's name)."""

    must: str
    help: str


Positive = Annotated[int, Field(gt=0), Rule("a positive integer", "set '{key}' to a whole number >= 1")]
NonNegative = Annotated[
    float,
    Field(ge=0),
    Rule("a non-negative number", "set '{key}' to a number such as the defaults in the spec reference"),
]
Path = Annotated[str, Rule("an absolute path", "mflow passes absolute directories")]
Engine = Literal["reference", "megatron"]
Precision = Literal["bf16", "fp32"]


class _Config(BaseModel):
    # Strict: a number is never read from a string, nor an integer from 1.0 or true.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TrainConfig(_Config):
    stage: Literal["train"]
    engine: Engine
    shards: Path
    data: Path
    output: Path
    scratch: Path
    tp: Positive
    pp: Positive
    dp: Positive
    iterations: Positive
    seq_length: Positive
    micro_batch_size: Positive
    global_batch_size: Positive
    lr: NonNegative
    min_lr: NonNegative
    warmup_iterations: Annotated[int, Field(ge=0), Rule("an integer >= 0", "use 0 for no warmup")]
    lr_decay: Literal["cosine", "linear", "constant"]
    weight_decay: NonNegative
    adam_beta1: NonNegative
    adam_beta2: NonNegative
    clip_grad: NonNegative
    seed: Annotated[int, Rule("an integer", "set '{key}' to a whole number")]
    precision: Precision
    save_interval: Positive
    log_interval: Positive
    eval_interval: Positive
    eval_iters: Positive
    attention: Literal["sdpa", "local"]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def _check(self, path: str) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"config {path}: min_lr {self.min_lr} exceeds lr {self.lr}", "lower min_lr")
        if self.global_batch_size % (self.micro_batch_size * self.dp) != 0:
            raise ConfigError(
                f"config {path}: global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp = {self.micro_batch_size}*{self.dp}",
                "choose global_batch_size = micro_batch_size * dp * k",
            )
        _check_dirs(path, self, inputs=("shards", "data"), outputs=("output", "scratch"))


class EvaluateConfig(_Config):
    stage: Literal["evaluate"]
    engine: Engine
    shards: Path
    data: Path
    output: Path
    tp: Positive
    pp: Annotated[int, Field(ge=1, le=1), Rule("1", "evaluation runs the whole depth on each rank: pp is 1")]
    seq_length: Positive
    micro_batch_size: Positive
    eval_iters: Positive
    splits: Annotated[list[Literal["train", "valid", "test"]], Rule("a list of splits", "name splits of the dataset")]
    baseline: Annotated[str | None, Rule("an absolute path or null", "mflow passes absolute directories")]
    prompts: Annotated[list[str], Rule("a list of strings", "quote each prompt")]
    max_new_tokens: Annotated[int, Field(ge=0), Rule("an integer >= 0", "use 0 to skip generation")]
    precision: Precision

    def _check(self, path: str) -> None:
        baseline = ("baseline",) if self.baseline is not None else ()
        _check_dirs(path, self, inputs=("shards", "data", *baseline), outputs=("output",))


class VerifyExportConfig(_Config):
    stage: Literal["verify_export"]
    hf: Path
    shards: Path
    prompts: Annotated[
        list[str],
        Field(min_length=1),
        Rule("a non-empty list of strings", "give at least one prompt to compare greedy generation"),
    ]
    max_new_tokens: Annotated[int, Field(ge=1), Rule("an integer >= 1", "use e.g. 16")]
    output: Path

    def _check(self, path: str) -> None:
        _check_dirs(path, self, inputs=("hf", "shards"), outputs=("output",))


def _check_dirs(path: str, cfg: _Config, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """Every path is absolute; the inputs' directories exist (the outputs are made later)."""
    for key in inputs + outputs:
        value = getattr(cfg, key)
        if not os.path.isabs(value):
            raise ConfigError(
                f"config {path}: key '{key}' must be an absolute path, got {value!r}",
                "mflow passes absolute directories",
            )
        if key in inputs and not os.path.isdir(value):
            raise ConfigError(
                f"config {path}: directory '{key}' = {value} does not exist",
                "run the upstream stage first, or fix the path",
            )


def _problem(cls: type[_Config], obj: dict[str, Any], error: dict[str, Any]) -> tuple[str, str]:
    """(what is wrong, what to do) for one of pydantic's errors."""
    key = str(error["loc"][0])
    regenerate = "regenerate the config with this mflow version"
    if error["type"] == "missing":
        return f"missing key '{key}'", f"mflow writes every key; {regenerate}"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{key}'", f"mflow writes only the keys of its schema; {regenerate}"
    name = key + "[]" if len(error["loc"]) > 1 else key  # an item of a list
    if error["type"] == "literal_error":
        return f"key '{name}' is {error['input']!r}", f"use one of {error['ctx']['expected']}"
    rule = next((m for m in cls.model_fields[key].metadata if isinstance(m, Rule)), None)
    if rule is None:
        return f"key '{name}': {error['msg']}, got {obj[key]!r}", "regenerate the config with this mflow version"
    return f"key '{key}' must be {rule.must}, got {obj[key]!r}", rule.help.format(key=key)


def _read_json(path: str) -> dict[str, Any]:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}", "pass the config file mflow wrote") from e
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {path} is {size} bytes, more than {MAX_CONFIG_BYTES}", "a workload config is a small JSON object"
        )
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config {path} is not valid JSON: {e}", "fix the JSON syntax") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"config {path} must hold a JSON object", "wrap the keys in {...}")
    return obj


def parse(cls: type[_Config], path: str, obj: dict[str, Any]):
    """The config of `cls` from the JSON object `obj` read from `path`, or a ConfigError that
    names every problem."""
    (stage,) = get_args(cls.model_fields["stage"].annotation)
    if obj.get("stage") != stage:
        raise ConfigError(
            f"config {path}: key 'stage' is {obj.get('stage')!r}, expected {stage!r}",
            f"launch mflow_workloads.{stage} only with a {stage} config",
        )
    try:
        cfg = cls.model_validate(obj)
    except ValidationError as e:
        problems = [_problem(cls, obj, err) for err in e.errors()]
        if len(problems) == 1:
            raise ConfigError(f"config {path}: {problems[0][0]}", problems[0][1]) from None
        lines = "".join(f"\n  {what} ({todo})" for what, todo in problems)
        raise ConfigError(f"config {path}: {len(problems)} problems:{lines}", "each problem says what to do") from None
    cfg._check(path)
    return cfg


def load_train(path: str) -> TrainConfig:
    return parse(TrainConfig, path, _read_json(path))


def load_evaluate(path: str) -> EvaluateConfig:
    return parse(EvaluateConfig, path, _read_json(path))


def load_verify_export(path: str) -> VerifyExportConfig:
    return parse(VerifyExportConfig, path, _read_json(path))
