"""Text that is not plait's own reaches the console as it reads, through every command that
reports an error.

Exception messages, failure lines, gRPC details, paths, hosts and job ids are printed by a
rich console, which reads `[...]` as markup: a Gloo error's source location
(`[/__w/pytorch/.../pair.cc:553]`) is a closing tag that raises `MarkupError` in place of the
line, and `[red]` would vanish into a colour. Each case injects such text where a command
reports it and checks the command prints it literally and exits with its own error code.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from rich.console import Console
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from typer.testing import CliRunner

from plait.core.errors import PlaitError
from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
from plait.tools import (
    ckpt_commands,
    cli,
    daemon_commands,
    daemon_targets,
    data_commands,
    kernels_commands,
    plan_commands,
    profile_commands,
)
from plait.training.launch_errors import record_rank_error

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"

GLOO = "[/__w/x/pair.cc:553] Connection closed by peer"
STYLED = "[red]oops[/red]"
MESSAGE = f"{GLOO}; {STYLED}"
HOST = "[red]node[/red]:7461"  # a host as the operator typed it


@dataclass(frozen=True)
class Invocation:
    args: list[str]
    code: int  # the command's own exit code for this report
    shown: tuple[str, ...] = (GLOO, STYLED)  # what must appear, exactly as written


Case = Callable[[pytest.MonkeyPatch, Path], Invocation]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(make: Case) -> Case:
        CASES[name] = make
        return make

    return register


def raising(exc: Exception) -> Callable[..., object]:
    def fail(*args: object, **kwargs: object) -> object:
        raise exc

    return fail


class Unreachable(grpc.RpcError):
    """A daemon's failed call, its details carrying brackets."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return MESSAGE


def every_host_unreachable(hosts: list[str], *args: object, **kwargs: object) -> dict:
    return {host: Unreachable() for host in hosts}


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command module prints to one wide, colourless console: no line is wrapped inside
    the text under test, whatever the terminal running the tests."""
    for module in (
        cli,
        ckpt_commands,
        daemon_commands,
        data_commands,
        kernels_commands,
        plan_commands,
        profile_commands,
    ):
        monkeypatch.setattr(module, "console", Console(width=1000, color_system=None))


# --- plait train, config, plugins, init -------------------------------------------------------


@case("train")
def _train(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.core.config.load_config", raising(PlaitError(MESSAGE)))
    return Invocation(["train", str(TINY)], 2)


def _launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exc: Exception) -> list[str]:
    """`plait train` of the tiny config up to torchrun, whose run raises `exc`."""
    monkeypatch.setenv("PLAIT_JOB_ID", "escapes")  # train sets it when unset
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    # The config's checks are not what is tested here (and take the most time).
    monkeypatch.setattr("plait.core.engine.check_config", lambda *args, **kwargs: None)
    monkeypatch.setattr("torch.distributed.run.run", raising(exc))
    return ["train", str(TINY), "--set", f"train.run_dir={tmp_path / 'run'}"]


@case("train-failure-line")
def _train_failure_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    # A rank's error file as the rank writes it, read back by torchrun's ProcessFailure.
    error_file = tmp_path / "error.json"
    assert record_rank_error(RuntimeError(MESSAGE), {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    failed = ChildFailedError("plait.tools.trainer", {0: failure})
    args = _launch(monkeypatch, tmp_path, failed)
    return Invocation(args, 1, (f"training failed: rank 0 failed: RuntimeError: {MESSAGE}",))


@case("train-launcher-error")
def _train_launcher_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    args = _launch(monkeypatch, tmp_path, RuntimeError(MESSAGE))
    return Invocation(args, 1, (f"training failed: {MESSAGE}",))


@case("config-show")
def _config_show(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.core.config.load_config", raising(PlaitError(MESSAGE)))
    return Invocation(["config", "show", str(TINY)], 2)


@case("config-validate")
def _config_validate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.core.config.load_config", raising(PlaitError(MESSAGE)))
    return Invocation(["config", "validate", str(TINY)], 2)


@case("config-validate-path")
def _config_validate_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    config = tmp_path / "[red]runs" / "tiny.toml"  # an open tag: it would turn the rest red
    config.parent.mkdir()
    shutil.copy(TINY, config)
    return Invocation(["config", "validate", str(config)], 0, (f"ok: {config} is valid",))


@case("plugins")
def _plugins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.core.plugins.Plugins.create", raising(PlaitError(MESSAGE)))
    return Invocation(["plugins"], 2)


@case("init")
def _init(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.tools.starter_configs.write_starter", raising(PlaitError(MESSAGE)))
    return Invocation(["init", "tiny", str(tmp_path / "tiny.toml")], 2)


# --- plait data, schedule, kernels -----------------------------------------------------------


@case("data-prepare")
def _data_prepare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a document\n")
    monkeypatch.setattr("plait.plugins.data.tokenizer.get_tokenizer", raising(ValueError(MESSAGE)))
    return Invocation(["data", "prepare", str(corpus), "-o", str(tmp_path / "tokens")], 1)


@case("data-info")
def _data_info(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    from plait.plugins.data.errors import DataError

    monkeypatch.setattr("plait.plugins.data.token_files.TokenFile", raising(DataError(MESSAGE)))
    return Invocation(["data", "info", str(tmp_path)], 1)


@case("data-info-path")
def _data_info_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    missing = tmp_path / "[red]tokens[/red]"
    return Invocation(["data", "info", str(missing)], 1, (str(missing),))


@case("schedule-show")
def _schedule_show(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.tools.schedule_commands._programs", raising(PlaitError(MESSAGE)))
    return Invocation(["schedule", "show"], 2)


def _choices_in(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    from plait.plugins.kernels_auto.selection import ChoiceStore

    store = ChoiceStore(path)
    monkeypatch.setattr("plait.plugins.kernels_auto.selection.default_store", lambda: store)


@case("kernels")
def _kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr(kernels_commands, "resolve_providers", raising(PlaitError(MESSAGE)))
    return Invocation(["kernels", str(TINY)], 2)


@case("kernels-dtype")
def _kernels_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    return Invocation(["kernels", "--dtype", STYLED], 2, (f"--dtype '{STYLED}'",))


@case("kernels-unresolved")
def _kernels_unresolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    # An override naming a provider that raised: the table points at the numbered error.
    chosen = {"rms_norm": {"cpu": f"error: {MESSAGE}", "cuda": "torch"}}
    answer = (chosen, {"rms_norm": ["torch (cpu, cuda)"]}, [])
    monkeypatch.setattr(kernels_commands, "resolve_providers", lambda *a, **k: answer)
    store = tmp_path / "[red]cache[/red]" / "choices.json"
    _choices_in(monkeypatch, store)
    shown = (f"(1) rms_norm on cpu: {MESSAGE}", f"no measured kernel choices in {store}")
    return Invocation(["kernels", str(TINY)], 0, shown)


@case("kernels-measured")
def _kernels_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    from plait.plugins.kernels_auto.selection import Choice, ChoiceStore

    answer = ({"rms_norm": {"cpu": "torch", "cuda": "torch"}}, {"rms_norm": ["torch"]}, [])
    monkeypatch.setattr(kernels_commands, "resolve_providers", lambda *a, **k: answer)
    store = tmp_path / "choices.json"
    choice = Choice(
        op="rms_norm", device="cuda", dtype="bfloat16", shapes="(8, 64)", provider="torch",
        timings={"torch": 1e-5}, skipped={"triton": MESSAGE},
    )  # fmt: skip
    ChoiceStore(store).put(HOST, choice)
    _choices_in(monkeypatch, store)
    shown = (f"measured kernel choices: {HOST}", GLOO, STYLED)
    return Invocation(["kernels", str(TINY)], 0, shown)


# --- plait ckpt, plan -------------------------------------------------------------------------


@case("ckpt-info")
def _ckpt_info(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr(
        "plait.plugins.checkpoint.storage.resolve_checkpoint", raising(PlaitError(MESSAGE))
    )
    return Invocation(["ckpt", "info", str(tmp_path)], 2)


@case("ckpt-export")
def _ckpt_export(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr(
        "plait.plugins.checkpoint.offline.model_weights", raising(PlaitError(MESSAGE))
    )
    return Invocation(["ckpt", "export", str(tmp_path), "-o", str(tmp_path / "hf")], 2)


@case("ckpt-import")
def _ckpt_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.plugins.huggingface.weights.import_hf", raising(PlaitError(MESSAGE)))
    return Invocation(["ckpt", "import", str(tmp_path), "-o", str(tmp_path / "ckpt")], 2)


@case("ckpt-convert")
def _ckpt_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr(
        "plait.plugins.checkpoint.offline.read_checkpoint", raising(PlaitError(MESSAGE))
    )
    args = ["ckpt", "convert", str(tmp_path), "-o", str(tmp_path / "x.pt"), "--to", "torch"]
    return Invocation(args, 2)


@case("plan-search")
def _plan_search(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.planner.published.resolve_shape", raising(PlaitError(MESSAGE)))
    return Invocation(["plan", "search", "llama:7b", "--world", "8", "--global-batch", "64"], 2)


@case("plan-calibrate")
def _plan_calibrate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.planner.daemon_client.capture_trace", raising(OSError(MESSAGE)))
    shown = (f"could not read spans from {HOST}: {MESSAGE}",)
    return Invocation(["plan", "calibrate", "--host", HOST], 2, shown)


@case("plan-explain")
def _plan_explain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.core.config.read_toml", raising(PlaitError(MESSAGE)))
    return Invocation(["plan", "explain", "--config", str(TINY), "--world", "8"], 2)


# --- the daemon and the commands that query it -------------------------------------------------


@case("daemon")
def _daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    monkeypatch.setattr("plait.daemon.config.DaemonConfig", raising(ValueError(MESSAGE)))
    return Invocation(["daemon", "--no-calibrate"], 2)


def _hosts_unreachable(monkeypatch: pytest.MonkeyPatch, module: object) -> tuple[str, ...]:
    # Commands asking questions go through `daemon_targets`; the others call every host.
    monkeypatch.setattr(module, "call_all", every_host_unreachable)
    monkeypatch.setattr(daemon_targets, "call_each", every_host_unreachable)
    return (f"{HOST}: UNAVAILABLE: {MESSAGE}",)


@case("status")
def _status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, daemon_commands)
    return Invocation(["status", "--host", HOST], 1, shown)


def _status_answers(
    monkeypatch: pytest.MonkeyPatch,
    state: daemon_pb2.StatusResponse,
    ranks: list[metrics_pb2.RankInfo],
) -> None:
    """Every host answers `plait status` with `state` and `ranks`."""
    answer = (state, daemon_pb2.ListRanksResponse(ranks=ranks), daemon_pb2.GetMetricsResponse())
    monkeypatch.setattr(
        daemon_targets, "call_each", lambda hosts, *a, **k: dict.fromkeys(hosts, answer)
    )


@case("status-lighthouse")
def _status_lighthouse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    # The daemon could not read the lighthouse it hosts: the error is in the table's title.
    state = daemon_pb2.StatusResponse()
    state.lighthouse.address, state.lighthouse.error = "127.0.0.1:29510", MESSAGE
    _status_answers(monkeypatch, state, [])
    return Invocation(["status", "--host", HOST], 0, (f"not read ({MESSAGE})",))


@case("status-ranks")
def _status_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    # A job id (telemetry.job_id is the operator's) and a host in the rank table's cells.
    rank = metrics_pb2.RankInfo(job_id=MESSAGE, rank=0, host=HOST, world_size=1, status="live")
    _status_answers(monkeypatch, daemon_pb2.StatusResponse(ranks=1), [rank])
    return Invocation(["status", "--host", "127.0.0.1:7461"], 0, (MESSAGE, HOST))


@case("top")
def _top(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, daemon_commands)
    return Invocation(["top", "--once", "--host", HOST], 1, shown)


@case("bottleneck")
def _bottleneck(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, daemon_commands)
    return Invocation(["bottleneck", "--host", HOST], 1, shown)


@case("trace")
def _trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, daemon_commands)
    output = tmp_path / "trace.json"
    return Invocation(["trace", "--host", HOST, "--seconds", "0", "-o", str(output)], 1, shown)


@case("profile")
def _profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, profile_commands)
    output = tmp_path / "profile.json"
    args = ["profile", "--job", "j", "--steps", "1", "-o", str(output), "--host", HOST]
    return Invocation(args, 1, shown)


@case("profile-job")
def _profile_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    # Over two hosts, --seconds needs the ranks' step rates; none answer, so the job is named.
    _hosts_unreachable(monkeypatch, profile_commands)
    output = tmp_path / "profile.json"
    args = ["profile", "--job", MESSAGE, "--seconds", "1", "-o", str(output)]
    args += ["--host", "a:1", "--host", "b:1"]
    return Invocation(args, 1, (f"error: the ranks of job {MESSAGE} have not",))


@case("stacks")
def _stacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, profile_commands)
    return Invocation(["stacks", "--job", "j", "--host", HOST], 1, shown)


@case("memory")
def _memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Invocation:
    shown = _hosts_unreachable(monkeypatch, profile_commands)
    args = ["memory", "--job", "j", "-o", str(tmp_path / "memory"), "--host", HOST]
    return Invocation(args, 1, shown)


@pytest.mark.parametrize("make", CASES.values(), ids=CASES.keys())
def test_foreign_text_is_printed_as_it_reads(
    make: Case, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    invocation = make(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli.app, invocation.args)
    # A MarkupError (or any other exception) is a traceback instead of the report.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == invocation.code, result.output
    # A table's title wraps at the table's width, between words: compare words.
    printed = " ".join(result.output.split())
    for text in invocation.shown:
        assert " ".join(text.split()) in printed, result.output


def test_main_prints_an_uncaught_plait_error_as_it_reads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "app", raising(PlaitError(MESSAGE)))
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    assert f"error: {MESSAGE}" in capsys.readouterr().out
