"""Configuration: TOML files validated into pydantic models, with `a.b=c` overrides.

Core sections are typed here. A plugin's own section (`[ddp]`, `[zero]`, `[tp]`, …) is validated
by the `config_cls` of the record it registered, a feature's (`[checkpoint_io]`,
`[fault_tolerance]`, `[resilience]`, …) by the class its owner declared
(`plait_register_config_sections`), so an unknown section or field is an error that
names what is allowed. Errors always name the field, the bad value and the allowed values.
"""

from __future__ import annotations

import ast
import difflib
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from plait.core.errors import ConfigError

log = logging.getLogger(__name__)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib


class Section(BaseModel):
    """Base for config sections: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    """Which model to build; `size` is a preset of the family, other fields override it."""

    name: str = Field("llama", description="model family, e.g. 'llama' or 'gpt2'")
    size: str = Field("tiny", description="preset: tiny, small, 1b, 7b, 70b, …")
    overrides: dict[str, int | float | bool | str] = Field(
        default_factory=dict, description="fields of the model's own config to override"
    )


class DataSection(Section):
    """Where training tokens come from and how documents are laid into rows.

    `packing` and `document_mask` apply to a token directory with document offsets (what
    `plait data prepare` writes); a directory without them (format version 1, or the bundled
    corpus) is read as one stream cut into windows, and only the default `packing` is accepted.
    """

    path: str = Field("", description="directory of prepared token files; '' = bundled corpus")
    validation_path: str = Field(
        "",
        description="directory of prepared token files (e.g. held-out conversations) that the "
        "validation loss is computed on every train.eval_every steps, with their own document "
        "and loss masks, in place of a held-out split of data.path; '' = hold out "
        "train.eval_fraction of data.path",
    )
    seq_len: int = Field(128, gt=1, description="tokens per training sequence")
    packing: Literal["concat_split", "first_fit", "none"] = Field(
        "concat_split",
        description="how documents fill rows of seq_len tokens: 'concat_split' lays them end to "
        "end in a shuffled order and cuts rows (no padding but the last row's), 'first_fit' "
        "bin-packs them first-fit-decreasing and pads each row, 'none' puts one document per "
        "row and pads it; a document longer than a row is cut into pieces that count as "
        "documents",
    )
    document_mask: bool = Field(
        True,
        description="positions restart at 0 at every document of a packed row, so attention "
        "stays inside a document; false = positions 0..seq_len-1 across the whole row (targets "
        "never cross a document boundary either way)",
    )


class OptimizerSection(Section):
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR as a fraction of lr")
    warmup_steps: int = Field(10, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)


class TrainSection(Section):
    steps: int = Field(50, gt=0)
    global_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, all ranks")
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="sequences per forward pass on one rank; unset = the whole batch a rank is "
        "given is one micro-batch, or under a pipeline enough micro-batches for the schedule "
        "(at least 2 x pp where the rows allow)",
    )
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        description="micro-batches per optimizer step when the loop calls engine(batch), "
        "engine.backward(loss), engine.step() itself",
    )
    max_grad_norm: float = Field(
        0.0, ge=0, description="clip the global gradient norm to this; 0 = no clipping"
    )
    flops_per_token: float = Field(
        0.0,
        ge=0,
        description="training FLOPs per token for MFU; 0 = the model family's formula, or "
        "counted with torch's FlopCounterMode on the first step for any other model",
    )
    seed: int = 1234
    log_every: int = Field(
        10,
        gt=0,
        description="print a log line every N steps when stdout is not a terminal (a terminal "
        "gets a live progress bar instead)",
    )
    run_dir: str = Field(
        "",
        description="directory for run records: the resolved config.toml, metrics.jsonl (one "
        "line per step), TensorBoard events when tensorboard is installed, and launch.log when "
        "a rank fails; '' = none",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="validation loss on the held-out split every N steps (and after the last); "
        "0 = no validation and no held-out split",
    )
    eval_fraction: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="share of the data's windows held out for validation when eval_every > 0 "
        "(the end of the token stream)",
    )
    eval_batches: int = Field(
        2, gt=0, description="global batches of the held-out split each validation reads"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    collective_timeout_seconds: float = Field(
        600.0, gt=0, description="a collective that takes longer fails (process-group timeout)"
    )


class ParallelSection(Section):
    """Degrees per mesh axis and the strategy that implements each axis (by plugin name)."""

    dp: int = Field(-1, description="data-parallel degree; -1 = world size / (pp·cp·tp)")
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)
    ep: int = Field(
        1,
        gt=0,
        description="expert-parallel degree, carved out of dp (it must divide dp); above 1 "
        "the experts are sharded by ep_strategy",
    )
    dp_shard: int | Literal["node"] | None = Field(
        None,
        description="sharded data parallelism (HSDP): the dp ranks ZeRO shards over, "
        "dp_replicate = dp / dp_shard copies of them; 'node' = the dp ranks of one node; "
        "unset = every dp rank (plain ZeRO)",
    )
    dp_strategy: str = Field("ddp", description="strategy for the dp axis: ddp, zero1, …")
    tp_strategy: str = "megatron"
    pp_strategy: str = "pipeline"
    cp_strategy: str = Field("ring", description="strategy for the cp axis (context parallel)")
    ep_strategy: str = Field(
        "",
        description="strategy for expert parallelism; '' = 'ep' when ep > 1 and none at ep = 1; "
        "named at ep = 1 it runs with the experts replicated (the MoE balancing loss scaled "
        "per micro-batch)",
    )
    transforms: dict[str, str] = Field(
        default_factory=dict,
        description="model transforms by axis, e.g. {ac = 'checkpoint', precision = 'amp'}",
    )

    @property
    def expert_strategy(self) -> str | None:
        """The strategy expert parallelism runs under, or None when it does not run."""
        return self.ep_strategy or ("ep" if self.ep > 1 else None)

    def transform_strategies(self) -> dict[str, str]:
        """The model transforms by axis: `transforms`, and expert parallelism's strategy when
        it runs (the ep axis is not a mesh axis: it splits dp). The one place both are read."""
        strategies = dict(self.transforms)
        if self.expert_strategy is not None:
            strategies["ep"] = self.expert_strategy
        return strategies

    @model_validator(mode="after")
    def _ep_named_once(self) -> ParallelSection:
        if "ep" in self.transforms:
            raise ValueError(
                "transforms.ep is parallel.ep_strategy now (a config file's transforms.ep is "
                "moved there when it loads)"
            )
        return self

    @model_validator(mode="after")
    def _dp_positive_or_auto(self) -> ParallelSection:
        if self.dp == 0 or self.dp < -1:
            raise ValueError(f"dp must be -1 (auto) or a positive degree, got {self.dp}")
        if isinstance(self.dp_shard, int) and self.dp_shard < 1:
            raise ValueError(f"dp_shard must be a positive degree or 'node', got {self.dp_shard}")
        return self


# The schedule a job with parallel.pp > 1 runs when it names none (Megatron-LM's and
# torchtitan's default), and the one without pipeline parallelism.
PIPELINE_DEFAULT_SCHEDULE = "1f1b"
PLAIN_DEFAULT_SCHEDULE = "accumulate"


class ScheduleSection(Section):
    name: str = Field(
        "",
        description="step schedule plugin: accumulate, 1f1b, gpipe, …; '' = 1f1b when "
        "parallel.pp > 1, else accumulate",
    )
    virtual_stages: int = Field(1, gt=0, description="model chunks per pipeline rank")
    # True when `name` was chosen because the config named none (the banner says so).
    _chosen_by_default: bool = PrivateAttr(default=False)

    @property
    def chosen_by_default(self) -> bool:
        return self._chosen_by_default

    def choose_default(self, pipeline_stages: int) -> None:
        """Fill an unnamed schedule: 1F1B with pipeline parallelism, else accumulation."""
        if self.name:
            return
        pipelined = pipeline_stages > 1
        self.name = PIPELINE_DEFAULT_SCHEDULE if pipelined else PLAIN_DEFAULT_SCHEDULE
        self._chosen_by_default = True


class KernelsSection(Section):
    prefer: list[str] = Field(
        default_factory=list,
        description="providers to ask first, in order (e.g. ['triton', 'torch']); [] = the "
        "first plugin that answers (Triton on CUDA, the torch reference elsewhere)",
    )
    overrides: dict[str, str] = Field(
        default_factory=dict, description="provider per op, e.g. {attention = 'torch'}"
    )
    provider: Literal["auto", "prefer"] | None = Field(
        None,
        description="'auto': time every provider of an op at its first call's shapes and use "
        "the fastest (cached per machine); 'prefer': the preference order only; unset: 'auto' "
        "on CUDA when prefer is empty. overrides win over 'auto'",
    )

    @model_validator(mode="after")
    def _auto_or_prefer(self) -> KernelsSection:
        # Measuring among providers while also ranking them by hand: one of the two is ignored.
        if self.provider == "auto" and self.prefer:
            raise ValueError(
                f"kernels.provider = 'auto' chooses by measurement, kernels.prefer = "
                f"{self.prefer} by order; set one (overrides combine with either)"
            )
        return self


class TelemetrySection(Section):
    enabled: bool = True
    daemon: str = Field("", description="host:port of the node daemon; '' = $PLAIT_DAEMON")
    job_id: str = ""


class CommSection(Section):
    """`[comm]`: the communication algorithm that takes traffic over, and its options.

    `algorithm` names one registered `CommAlgorithmRecord` ("torch" = none: the backend's
    collectives as they are). Each algorithm's options live in its own sub-table, validated by
    the record's `config_cls`::

        [comm]
        algorithm = "powersgd"

        [comm.powersgd]
        rank = 2
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    algorithm: str = Field(
        "torch", description="torch (no algorithm), ring, tree, fp16, bf16, powersgd, …"
    )

    @model_validator(mode="after")
    def _algorithm_is_a_name(self) -> CommSection:
        if not self.algorithm.strip():
            raise ValueError("comm.algorithm must name an algorithm, e.g. 'torch' or 'ring'")
        return self

    @property
    def option_tables(self) -> dict[str, Any]:
        """The `[comm.<name>]` sub-tables, as given."""
        return dict(self.model_extra or {})

    def options(self, name: str, cls: type[BaseModel]) -> Any:
        """Algorithm `name`'s validated `[comm.<name>]` options (defaults when absent)."""
        raw = self.option_tables.get(name, {})
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(
                _format_validation_error(exc, prefix=f"comm.{name}", model=cls)
            ) from None


class PluginsSection(Section):
    disable: list[str] = Field(default_factory=list, description="plugin names to block")
    inert_selection: Literal["error", "warn"] = Field(
        "error",
        description="a plugin selected by name (comm.algorithm, schedule.name, kernels.prefer) "
        "that takes over nothing in the first step where it could: 'error' stops the run, "
        "'warn' says so once and trains on with the default",
    )


class PlaitConfig(BaseModel):
    """The whole job. Plugin sections land in `extensions`, validated by their plugins."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    plugins: PluginsSection = Field(default_factory=PluginsSection)
    comm: CommSection = Field(default_factory=CommSection)

    @model_validator(mode="after")
    def _schedule_named(self) -> PlaitConfig:
        self.schedule.choose_default(self.parallel.pp)
        return self

    def plugins_switched_off(self) -> tuple[str, ...]:
        """Plugins a section turns off, beside `plugins.disable`: `telemetry.enabled = false`
        takes the telemetry plugin out (it wraps every comm op: a run without it pays
        nothing per op)."""
        return () if self.telemetry.enabled else ("telemetry",)

    @property
    def extensions(self) -> dict[str, dict[str, Any]]:
        """Plugin sections (anything not a core section), as raw dicts."""
        return dict(self.model_extra or {})

    def section(self, name: str, cls: type[BaseModel]) -> Any:
        """Validate and return a plugin's section (defaults if the file has none)."""
        raw = self.extensions.get(name, {})
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, prefix=name, model=cls)) from None


CORE_SECTIONS = tuple(PlaitConfig.model_fields)

# Keys that moved to the section of the feature that owns them, old path -> new path. A config
# written before the move still loads: the value is moved (a note names the new key); the old
# and the new key both set is an error naming both.
MOVED_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("checkpoint_io", "max_consecutive_nonfinite"): ("resilience", "max_consecutive_nonfinite"),
    ("checkpoint_io", "fault_injection"): ("resilience", "fault_injection"),
    ("parallel", "transforms", "ep"): ("parallel", "ep_strategy"),
}


def move_renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every key of `MOVED_KEYS` at its new place (in place)."""
    for old, new in MOVED_KEYS.items():
        *old_parents, old_key = old
        old_table = _table_at(data, old_parents)
        if old_table is None or old_key not in old_table:
            continue
        *new_parents, new_key = new
        new_table = _table_at(data, new_parents, create=True)
        if new_table is None:
            raise ConfigError(f"{'.'.join(new_parents)} must be a table to hold {'.'.join(new)}")
        if new_key in new_table:
            raise ConfigError(
                f"{'.'.join(old)} and {'.'.join(new)} are both set; {'.'.join(old)} is the old "
                f"name of {'.'.join(new)}: keep only {'.'.join(new)}"
            )
        new_table[new_key] = old_table.pop(old_key)
        log.warning("plait: config key %s is now %s", ".".join(old), ".".join(new))
    return data


def _table_at(
    data: dict[str, Any], path: Sequence[str], *, create: bool = False
) -> dict[str, Any] | None:
    node: Any = data
    for part in path:
        if not isinstance(node, dict):
            return None
        if part not in node and create:
            node[part] = {}
        node = node.get(part)
    return node if isinstance(node, dict) else None


def _format_validation_error(
    exc: ValidationError, *, prefix: str = "", model: type[BaseModel] | None = None
) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        value = err.get("input")
        allowed = _allowed_values(err)
        msg = f"{loc or '<root>'}: {err['msg']} (got {value!r})"
        if allowed:
            msg += f"; allowed: {allowed}"
        if err["type"] == "extra_forbidden" and model is not None:
            msg += did_you_mean(str(err["loc"][-1]), _field_names(model, err["loc"][:-1]))
        lines.append(msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
    """`"; did you mean 'x'?"` for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _field_names(model: type[BaseModel], path: Sequence[Any]) -> list[str]:
    """The field names of the section at `path` inside `model` (empty if not a section)."""
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _allowed_values(err: Any) -> str:
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return str(ctx["expected"])
    if err["type"] == "extra_forbidden":
        return "(this field does not exist; see `plait config show`)"
    for key in ("gt", "ge", "lt", "le"):
        if key in ctx:
            sym = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}[key]
            return f"a value {sym} {ctx[key]}"
    return ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b=c` into (['a', 'b'], value); the value is a TOML/Python literal or a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    path = [p.strip() for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key part")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            existing = node.setdefault(part, {})
            if not isinstance(existing, dict):
                raise ConfigError(
                    f"override {text!r}: {part!r} is a value ({existing!r}), not a section"
                )
            node = existing
        node[path[-1]] = value
    return data


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a dict; `ConfigError` naming the file when it is missing or not TOML."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_config(
    source: str | Path | Mapping[str, Any] | PlaitConfig | None = None,
    overrides: Sequence[str] = (),
) -> PlaitConfig:
    """Load a config from a TOML path, a dict, or an existing config, then apply overrides."""
    if isinstance(source, PlaitConfig):
        data = source.model_dump()
        if source.schedule.chosen_by_default:
            data["schedule"]["name"] = ""  # still the default: chosen again for these degrees
        if "algorithm" not in source.comm.model_fields_set:
            del data["comm"]["algorithm"]  # still unset: chosen again from the host map
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = _deep_copy(source)
    else:
        data = read_toml(Path(source))
    data = move_renamed_keys(apply_overrides(data, overrides))
    try:
        return PlaitConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, model=PlaitConfig)) from None


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def dump_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for `plait config show` (tomllib reads only)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    out = [f"{k} = {_toml_value(v)}" for k, v in scalars.items() if v is not None]
    for name, table in tables.items():
        out.extend(_dump_table(name, table))
    return "\n".join(out) + "\n"


def _dump_table(name: str, table: Mapping[str, Any]) -> list[str]:
    lines = ["", f"[{name}]"]
    nested = []
    for k, v in table.items():
        if isinstance(v, Mapping) and v and any(isinstance(x, Mapping) for x in v.values()):
            nested.append((k, v))
        elif v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in nested:
        lines.extend(_dump_table(f"{name}.{k}", v))
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
