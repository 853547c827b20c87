"""One job, one view, as an operator meets it: two `plait train` agents (`--nnodes 2`, a
static rendezvous, 2 ranks each) and two `plait daemon`s, one per "node", each node's ranks
exporting to its own daemon. With no `--host`, `plait status --job J` and `plait top --job J`
against daemon A show every rank of both nodes, as `--host A --host B` does; daemon A's page
shows node B's ranks; a hang planted on node B's rank 3 (held before the next step's
collective while the others wait in it) is named by a query to A, with its node and its
stacks (fetched from B); and after daemon B is killed, A's answer names node B as missing
within the deadline. The order of events rests on marker files the ranks write, not on time.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.hold_plugin_site import install_hold_plugin, plugin_env
from tests.free_ports import unassigned_port

ROOT = Path(__file__).resolve().parents[2]
JOB = "one-view"
HELD_STEP = 3
WAIT = 240.0
DEADLINE = "3"

# Where the hold plugin's dist-info lies (set once per module by `hold_plugin_site`).
PLUGIN_SITE: list[Path] = []


def _plait(*args: str) -> list[str]:
    return [sys.executable, "-m", "plait.tools.cli", *args]


def _env(**extra: str) -> dict[str, str]:
    return plugin_env(PLUGIN_SITE, **extra)


@pytest.fixture(scope="module", autouse=True)
def hold_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The hold plugin's dist-info, where `importlib.metadata` finds it on `PYTHONPATH`."""
    PLUGIN_SITE[:] = [install_hold_plugin(tmp_path_factory.mktemp("site"))]


def _wait(condition: Callable[[], bool], what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            texts = "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}:\n{texts}")
        time.sleep(0.2)


def _start_daemon(tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = tmp_path / f"daemon-{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            _plait("daemon", "--bind", "127.0.0.1:0", "--no-calibrate", "--hang-timeout", "2",
                   "--stale-floor", "120", "--web", "127.0.0.1:0"),
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(),
        )  # fmt: skip
    found: list[str] = []

    def listening() -> bool:
        text = log.read_text()
        assert process.poll() is None, text
        match = re.search(r"listening on (\S+:\d+)", text)
        if match and "live web page on" in text:
            found.append(match.group(1))
        return bool(found)

    _wait(listening, f"daemon {name}", [log])
    return process, found[0], log


def _cli(*args: str, daemon: str) -> tuple[int, str]:
    done = subprocess.run(
        _plait(*args), capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=_env(PLAIT_DAEMON=daemon),
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_any_daemon_answers_for_the_whole_two_node_job(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    daemon_a, address_a, log_a = _start_daemon(tmp_path, "a")
    daemon_b, address_b, log_b = _start_daemon(tmp_path, "b")
    agents: list[subprocess.Popen[bytes]] = []
    logs = [log_a, log_b]
    try:
        rendezvous = f"127.0.0.1:{unassigned_port()}"
        for node, address in ((0, address_a), (1, address_b)):
            log = tmp_path / f"agent{node}.log"
            logs.append(log)
            command = _plait(
                "train", "configs/tiny.toml", "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", str(node), "--rdzv-backend", "static",
                "--rdzv-endpoint", rendezvous,
                "--set", "train.steps=5", "--set", "train.global_batch_size=8",
                "--set", "train.micro_batch_size=2", "--set", f"train.run_dir={tmp_path}/run{node}",
                "--set", "train.collective_timeout_seconds=300",
                "--set", f"telemetry.daemon={address}", "--set", f"telemetry.job_id={JOB}",
            )  # fmt: skip
            hold = {"PLAIT_TEST_HOLD": str(HELD_STEP), "PLAIT_TEST_HOLD_RANKS": "3"}
            env = _env(PLAIT_TEST_MARKS=str(marks), **(hold if node else {}))
            with log.open("w") as out:
                agents.append(
                    subprocess.Popen(
                        command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
                    )
                )
        # Rank 3 (node 1) holds after step 3; ranks 0-2 go on into step 4's first collective.
        _wait(lambda: (marks / f"held.{HELD_STEP}.rank3").exists(), "rank 3 to hold", logs)

        # The hang, named from daemon A with rank 3's node, and its stacks fetched from B.
        status: dict = {}

        def hang_seen() -> bool:
            code, out = _cli("status", "--job", JOB, "--json", "--deadline", DEADLINE,
                             daemon=address_a)  # fmt: skip
            assert code == 0, out
            status.update(json.loads(out))
            return any(3 in h["missing_ranks"] for h in status["hangs"])

        _wait(hang_seen, "a hang missing rank 3, seen from daemon A", logs)
        assert status["job_daemons"]["answered"] == status["job_daemons"]["asked"] == 2
        assert sorted(r["rank"] for r in status["ranks"]) == [0, 1, 2, 3]
        places = {p["rank"]: p["where"] for p in status["rank_places"]}
        assert places[3] == f"node1 ({address_b})", places
        stacked = {s["rank"]: s for s in status["hang_stacks"]}
        assert 3 in stacked, status["hang_stacks"]
        assert "ft_hold_plugin" in json.dumps(stacked[3]), stacked[3]
        code, table = _cli("status", "--job", JOB, "--deadline", DEADLINE, daemon=address_a)
        assert code == 0, table
        assert f"3 on node1 ({address_b})" in table, table

        # `top --job J` from A equals `top --host A --host B` (the held job does not move).
        code, wide = _cli("top", "--json", "--job", JOB, "--deadline", DEADLINE, daemon=address_a)
        assert code == 0, wide
        code, listed = _cli("top", "--json", "--job", JOB, "--host", address_a,
                            "--host", address_b, daemon=address_a)  # fmt: skip
        assert code == 0, listed
        wide_doc, listed_doc = json.loads(wide), json.loads(listed)
        assert [(r["rank"], r["step"]) for r in wide_doc["ranks"]] == [
            (r["rank"], r["step"]) for r in listed_doc["ranks"]
        ]
        assert sorted(r["rank"] for r in wide_doc["ranks"]) == [0, 1, 2, 3]
        assert wide_doc["jobs"][0]["ranks_reporting"] == listed_doc["jobs"][0]["ranks_reporting"]

        # Daemon A's page shows node B's ranks, with the "k/N daemons" line.
        page = _page_document(log_a)
        page_ranks = sorted(r["rank"] for r in page["top"]["ranks"])
        assert page_ranks == [0, 1, 2, 3], page["top"]["ranks"]
        assert page["job_daemons"][0]["answered"] == 2, page["job_daemons"]
        # ...and the hung rank's stacks are one click away there, fetched from node B.
        clicked = _page_stacks(log_a, ranks=[3])
        assert [r["rank"] for r in clicked["ranks"]] == [3], clicked
        assert "ft_hold_plugin" in json.dumps(clicked["ranks"][0]), clicked

        # Daemon B dies mid-job: A's answer comes within the deadline and names node B.
        daemon_b.send_signal(signal.SIGKILL)
        daemon_b.wait(timeout=30)
        started = time.monotonic()
        code, out = _cli("top", "--json", "--job", JOB, "--deadline", DEADLINE, daemon=address_a)
        elapsed = time.monotonic() - started
        assert code == 1, out
        document = json.loads(out)
        assert document["job_daemons"]["answered"] == 1
        assert [(m["node"], m["address"]) for m in document["job_daemons"]["missing"]] == [
            (1, address_b)
        ]
        assert sorted(r["rank"] for r in document["ranks"]) == [0, 1]
        assert elapsed < float(DEADLINE) + 30, elapsed  # the CLI's own start included

        (marks / f"go.{HELD_STEP}").write_text("")
        for agent in agents:
            assert agent.wait(timeout=300) == 0, [p.read_text()[-3000:] for p in logs]
    finally:
        for process in (*agents, daemon_a, daemon_b):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def _page_document(log: Path) -> dict:
    """What daemon A's live page shows now (its JSON document, as the page's script reads it)."""
    import urllib.request

    url = re.search(r"live web page on (\S+)", log.read_text())
    assert url, log.read_text()
    with urllib.request.urlopen(url.group(1).rstrip("/") + "/api/page", timeout=30) as reply:
        return json.loads(reply.read())


def _page_stacks(log: Path, ranks: list[int]) -> dict:
    """What the page's "stacks" button gets back for `ranks` (the form the page's script posts)."""
    import urllib.parse
    import urllib.request

    url = re.search(r"live web page on (\S+)", log.read_text())
    assert url, log.read_text()
    body = urllib.parse.urlencode({"job": JOB, "ranks": ",".join(map(str, ranks))}).encode()
    request = urllib.request.Request(
        url.group(1).rstrip("/") + "/api/stacks", data=body, headers={"X-Plait": "1"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())
