"""The JSON configs mflow writes for each workload, checked key by key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20


def _read_json(path: str) -> dict[str, Any]:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}", "pass the config file mflow wrote") from e
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is {size} bytes, more than {MAX_CONFIG_BYTES}",
                          "a workload config is a small JSON object")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config {path} is not valid JSON: {e}", "fix the JSON syntax") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"config {path} must hold a JSON object", "wrap the keys in {...}")
    return obj


def _build(cls, path: str, obj: dict[str, Any], stage: str):
    if obj.get("stage") != stage:
        raise ConfigError(f"config {path}: key 'stage' is {obj.get('stage')!r}, expected {stage!r}",
                          f"launch mflow_workloads.{stage} only with a {stage} config")
    kwargs = {}
    for f in fields(cls):
        if f.name not in obj:
            raise ConfigError(f"config {path}: missing key '{f.name}'",
                              "mflow writes every key; regenerate the config with this mflow version")
        kwargs[f.name] = obj[f.name]
    cfg = cls(**kwargs)
    cfg.validate(path)
    return cfg


def _positive(path: str, **values: Any) -> None:
    for k, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"config {path}: key '{k}' must be a positive integer, got {v!r}",
                              f"set '{k}' to a whole number >= 1")


def _choice(path: str, key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"config {path}: key '{key}' is {value!r}", f"use one of {', '.join(map(str, allowed))}")


def _absdir(path: str, key: str, value: Any, must_exist: bool = True) -> None:
    if not isinstance(value, str) or not os.path.isabs(value):
        raise ConfigError(f"config {path}: key '{key}' must be an absolute path, got {value!r}",
                          "mflow passes absolute directories")
    if must_exist and not os.path.isdir(value):
        raise ConfigError(f"config {path}: directory '{key}' = {value} does not exist",
                          "run the upstream stage first, or fix the path")


@dataclass
class TrainConfig:
    stage: str
    engine: str
    shards: str
    data: str
    output: str
    scratch: str
    tp: int
    pp: int
    dp: int
    iterations: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    lr: float
    min_lr: float
    warmup_iterations: int
    lr_decay: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    clip_grad: float
    seed: int
    precision: str
    save_interval: int
    log_interval: int
    eval_interval: int
    eval_iters: int
    attention: str

    def validate(self, path: str) -> None:
        _choice(path, "engine", self.engine, ("auto", "reference", "megatron"))
        _choice(path, "lr_decay", self.lr_decay, ("cosine", "linear", "constant"))
        _choice(path, "precision", self.precision, ("bf16", "fp32"))
        _choice(path, "attention", self.attention, ("sdpa", "local"))
        _positive(path, tp=self.tp, pp=self.pp, dp=self.dp, iterations=self.iterations,
                  seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                  global_batch_size=self.global_batch_size, save_interval=self.save_interval,
                  log_interval=self.log_interval, eval_interval=self.eval_interval, eval_iters=self.eval_iters)
        if not isinstance(self.warmup_iterations, int) or self.warmup_iterations < 0:
            raise ConfigError(f"config {path}: 'warmup_iterations' must be >= 0", "use 0 for no warmup")
        for k in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"config {path}: key '{k}' must be a non-negative number, got {v!r}",
                                  f"set '{k}' to a number such as the defaults in the spec reference")
        if self.min_lr > self.lr:
            raise ConfigError(f"config {path}: min_lr {self.min_lr} exceeds lr {self.lr}", "lower min_lr")
        if self.global_batch_size % (self.micro_batch_size * self.dp) != 0:
            raise ConfigError(
                f"config {path}: global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp = {self.micro_batch_size}*{self.dp}",
                "choose global_batch_size = micro_batch_size * dp * k")
        _absdir(path, "shards", self.shards)
        _absdir(path, "data", self.data)
        _absdir(path, "output", self.output, must_exist=False)
        _absdir(path, "scratch", self.scratch, must_exist=False)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


@dataclass
class EvaluateConfig:
    stage: str
    engine: str
    shards: str
    data: str
    output: str
    tp: int
    pp: int
    seq_length: int
    micro_batch_size: int
    eval_iters: int
    splits: list
    baseline: Any
    prompts: list
    max_new_tokens: int
    precision: str

    def validate(self, path: str) -> None:
        _choice(path, "engine", self.engine, ("auto", "reference", "megatron"))
        _choice(path, "precision", self.precision, ("bf16", "fp32"))
        _positive(path, tp=self.tp, pp=self.pp, seq_length=self.seq_length,
                  micro_batch_size=self.micro_batch_size, eval_iters=self.eval_iters)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"config {path}: 'max_new_tokens' must be >= 0", "use 0 to skip generation")
        for s in self.splits:
            _choice(path, "splits[]", s, ("train", "valid", "test"))
        if not all(isinstance(p, str) for p in self.prompts):
            raise ConfigError(f"config {path}: 'prompts' must be a list of strings", "quote each prompt")
        _absdir(path, "shards", self.shards)
        _absdir(path, "data", self.data)
        _absdir(path, "output", self.output, must_exist=False)
        if self.baseline is not None:
            _absdir(path, "baseline", self.baseline)


@dataclass
class VerifyExportConfig:
    stage: str
    hf: str
    shards: str
    prompts: list
    max_new_tokens: int
    output: str

    def validate(self, path: str) -> None:
        _absdir(path, "hf", self.hf)
        _absdir(path, "shards", self.shards)
        _absdir(path, "output", self.output, must_exist=False)
        if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise ConfigError(f"config {path}: 'prompts' must be a non-empty list of strings",
                              "give at least one prompt to compare greedy generation")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"config {path}: 'max_new_tokens' must be >= 1", "use e.g. 16")


def load_train(path: str) -> TrainConfig:
    return _build(TrainConfig, path, _read_json(path), "train")


def load_evaluate(path: str) -> EvaluateConfig:
    return _build(EvaluateConfig, path, _read_json(path), "evaluate")


def load_verify_export(path: str) -> VerifyExportConfig:
    return _build(VerifyExportConfig, path, _read_json(path), "verify_export")
