"""The daemon's web page in headless Chromium, against real 2-rank jobs.

One job, paced by the test (`web_workers.train_paced`): the page with no job says so; then the
job's figures on the page, read from the DOM, equal `plait top --json` and `plait bottleneck
--json` for the same daemon, its slow rank is shown as the straggler, and the page keeps
updating (no reload) while the job runs; the memory and profile buttons hand back files. A
second job stalls a collective: the page shows the hang and, one click away, the ranks' stacks.
Screenshots are kept under the test's tmp folder (and in $PLAIT_WEB_SCREENSHOTS when set, which
is how docs/images/web-live.png and web-hung.png were made).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plait.daemon.server import DaemonServer
from plait.testing.distributed import run_distributed
from plait.tools.cli import app
from tests.daemon.analysis_workers import HANG_JOB_ID, stall_before_all_reduce
from tests.daemon.web_workers import WEB_JOB_ID, train_paced

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(
        not (os.path.exists(CHROMEDRIVER) and os.path.exists(CHROMIUM)),
        reason="Debian's chromium and chromium-driver are not installed (make test's set-up)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("selenium") is None, reason="selenium is not installed"
    ),
]
runner = CliRunner()
FIRST_STEPS = 4
SLOW_FORWARD = 0.1  # rank 1's extra seconds per forward: two forwards a step
STALL_SEQ = 2
WAIT = 90.0  # the bound on any wait for the page (a working run needs seconds)
# The hung job's bound: shorter than its rank's wait for the release (analysis_workers), so a
# page that never shows the hang fails here, not as a rank timing out.
HANG_WAIT = 45.0

# What the page shows of each figure, gathered from the DOM's data-value attributes: the raw
# numbers the page formats, beside the charts drawn from the same arrays.
READ_PAGE = """
const value = (td) => td.getAttribute("data-value");
const fields = (row) => Object.fromEntries(
  [...row.querySelectorAll("td[data-field]")].map((td) => [td.dataset.field, value(td)]));
const out = {sequence: document.body.dataset.sequence, jobs: {}, mfu: {}, breakdown: {},
             stragglers: {}, links: {}, charts: {}};
for (const row of document.querySelectorAll("#jobs tbody tr"))
  out.jobs[row.dataset.job] = fields(row);
for (const section of document.querySelectorAll("section.job")) {
  const job = section.dataset.job;
  out.mfu[job] = Object.fromEntries([...section.querySelectorAll(".mfu-now tbody tr")].map(
    (row) => [row.dataset.series === "job" ? "job" : "rank " + row.dataset.rank,
              value(row.querySelector("td[data-field=mfu]"))]));
  out.breakdown[job] = Object.fromEntries([...section.querySelectorAll(".breakdown tbody tr")]
    .map((row) => [row.dataset.rank, fields(row)]));
  out.stragglers[job] = Object.fromEntries([...section.querySelectorAll(".stragglers tbody tr")]
    .map((row) => [row.dataset.rank, {...fields(row), flagged: row.dataset.flagged}]));
  out.links[job] = Object.fromEntries([...section.querySelectorAll(".link-bytes tbody tr")]
    .map((row) => [row.dataset.rank, fields(row)]));
  // Drawn pixels of the compute colour in the stacked bars: the chart rendered its data.
  const canvas = section.querySelector(".breakdown-chart canvas");
  let compute = 0;
  if (canvas) {
    const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    for (let i = 0; i < pixels.length; i += 4)
      if (pixels[i] === 0x1e && pixels[i + 1] === 0x88 && pixels[i + 2] === 0xe5) compute++;
  }
  out.charts[job] = {mfu_points: Number(section.querySelector(".mfu-chart").dataset.points),
                     mfu_canvas: !!section.querySelector(".mfu-chart canvas"),
                     compute_pixels: compute};
}
return out;
"""
READ_HANG = """
const row = document.querySelector(`#hangs tr[data-job="${arguments[0]}"]`);
return row && Object.fromEntries([...row.querySelectorAll("td[data-field]")].map(
  (td) => [td.dataset.field, td.dataset.value]));
"""
BREAKDOWN_FIELDS = (
    "step_seconds",
    "compute_seconds",
    "exposed_comm_seconds",
    "data_wait_seconds",
    "pipeline_bubble_seconds",
    "optimizer_seconds",
    "host_other_seconds",
)
STRAGGLER_FIELDS = (
    "median_step_seconds",
    "step_score",
    "median_compute_seconds",
    "compute_score",
)
JOB_FIELDS = ("step", "tokens_per_second", "model_flops_per_second", "mfu", "step_seconds")


def cli_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def expected_figures(address: str) -> dict[str, Any]:
    """The same figures as `READ_PAGE` gathers, from `plait top --json` and `plait bottleneck
    --json` (the page's values are strings in the DOM: compared as numbers)."""
    top = cli_json("top", "--json", "--host", address)
    bottleneck = cli_json("bottleneck", "--json", "--host", address)
    out: dict[str, Any] = {"jobs": {}, "mfu": {}, "breakdown": {}, "stragglers": {}, "links": {}}
    for job in top["jobs"]:
        out["jobs"][job["job_id"]] = {f: job[f] for f in JOB_FIELDS}
        out["mfu"][job["job_id"]] = {"job": job["mfu"]} | {
            f"rank {r['rank']}": r["mfu"] for r in top["ranks"] if r["job_id"] == job["job_id"]
        }
    for r in top["ranks"]:
        sent = r["comm_bytes_per_step"] or {}
        if sent.get("intra_node") or sent.get("inter_node"):
            out["links"].setdefault(r["job_id"], {})[str(r["rank"])] = {
                "intra_node": sent["intra_node"],
                "inter_node": sent["inter_node"],
            }
    for r in bottleneck["ranks"]:
        out["breakdown"].setdefault(r["job_id"], {})[str(r["rank"])] = {
            f: r[f] for f in BREAKDOWN_FIELDS
        }
    for s in bottleneck["stragglers"]:
        out["stragglers"].setdefault(s["job_id"], {})[str(s["rank"])] = {
            **{f: s[f] for f in STRAGGLER_FIELDS},
            "flagged": s["flagged"],
        }
    return out


def as_numbers(page: dict[str, Any]) -> dict[str, Any]:
    """The page's figures, numbers parsed, flags as booleans, in `expected_figures`' shape."""
    jobs = {j: {f: float(v[f]) for f in JOB_FIELDS} for j, v in page["jobs"].items()}
    mfu = {j: {k: float(v) for k, v in series.items()} for j, series in page["mfu"].items()}
    breakdown = {
        j: {r: {f: float(v[f]) for f in BREAKDOWN_FIELDS} for r, v in ranks.items()}
        for j, ranks in page["breakdown"].items()
    }
    stragglers = {
        j: {
            r: {**{f: float(v[f]) for f in STRAGGLER_FIELDS}, "flagged": v["flagged"] == "true"}
            for r, v in ranks.items()
        }
        for j, ranks in page["stragglers"].items()
    }
    links = {
        j: {r: {f: float(v) for f, v in sent.items()} for r, sent in ranks.items()}
        for j, ranks in page["links"].items()
        if ranks
    }
    return {
        "jobs": jobs,
        "mfu": mfu,
        "breakdown": breakdown,
        "stragglers": stragglers,
        "links": links,
    }


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {"download.default_directory": str(tmp_path)})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, path: Path) -> None:
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, "an empty screenshot"
    if folder := os.environ.get("PLAIT_WEB_SCREENSHOTS"):
        shutil.copy(path, Path(folder) / path.name)


def click(driver: Any, selector: str) -> None:
    """A click on the button as it is now (the page redraws its tables on every push)."""
    driver.execute_script("document.querySelector(arguments[0]).click()", selector)


def until(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = WAIT) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition)
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}") from None


class Ranks:
    """`run_distributed` in a thread: the test drives the page while the ranks train."""

    def __init__(self, *args: Any) -> None:
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=args, daemon=True)
        self.thread.start()

    def _run(self, *args: Any) -> None:
        try:
            self.outcome["results"] = run_distributed(*args, timeout=WAIT + 60)
        except BaseException as exc:
            self.outcome["error"] = exc

    def join(self) -> dict[str, Any]:
        self.thread.join(timeout=WAIT + 90)
        assert not self.thread.is_alive(), "the ranks never finished"
        assert "error" not in self.outcome, self.outcome["error"]
        return self.outcome


@pytest.mark.timeout(240)
def test_live_page_shows_top_json_figures_the_straggler_and_updates(
    browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    paused, stop = tmp_path / "paused", tmp_path / "stop"
    server = DaemonServer(
        "127.0.0.1:0", web="127.0.0.1:0", web_interval=0.25, host_interval=0.5
    ).start()
    ranks: Ranks | None = None
    try:
        assert server.web is not None
        browser.get(server.web.url)
        no_job = until(browser, lambda d: d.find_element(By.ID, "no-job"), "its no-job notice")
        until(browser, lambda d: no_job.is_displayed(), "the no-job notice")
        assert "No job reports to this daemon" in no_job.text
        assert server.address in no_job.text
        screenshot(browser, tmp_path / "web-no-job.png")

        ranks = Ranks(
            train_paced, 2, server.address, FIRST_STEPS, str(paused), str(stop), 1, SLOW_FORWARD
        )
        # The ranks wait at `paused`: once every span of their steps arrived, the page and the
        # CLI read one unchanging store, so their figures must agree exactly.
        last: dict[str, Any] = {}

        def agreeing(driver: Any) -> bool:
            page = driver.execute_script(READ_PAGE)
            last["page"], last["cli"] = as_numbers(page), expected_figures(server.address)
            cli = last["cli"]
            settled = (
                len(cli["stragglers"].get(WEB_JOB_ID, {})) == 2
                # top and bottleneck are asked one after the other: the job may be in one only
                and cli["jobs"].get(WEB_JOB_ID, {}).get("step", -1) >= FIRST_STEPS - 1
            )
            return settled and last["page"] == cli

        try:
            until(browser, agreeing, "the figures of plait top --json and bottleneck --json")
        except AssertionError:
            raise AssertionError(f"page {last.get('page')}\n!= CLI {last.get('cli')}") from None
        figures = last["cli"]
        flags = {r: s["flagged"] for r, s in figures["stragglers"][WEB_JOB_ID].items()}
        assert flags == {"0": False, "1": True}, figures["stragglers"]
        shown = browser.execute_script(
            'return document.querySelector(`section.job .stragglers tr[data-rank="1"]`).innerText'
        )
        assert "STRAGGLER" in shown
        page = browser.execute_script(READ_PAGE)
        charts = page["charts"][WEB_JOB_ID]
        assert charts["mfu_canvas"] and charts["mfu_points"] >= 1 and charts["compute_pixels"]
        assert set(page["mfu"][WEB_JOB_ID]) == {"job", "rank 0", "rank 1"}
        # DDP's gradient all-reduces between two ranks of one host: bytes inside the node only.
        links = figures["links"][WEB_JOB_ID]
        assert set(links) == {"0", "1"} and all(v["intra_node"] > 0 for v in links.values())

        # Live: the ranks go on; the same page (no reload) shows their later steps.
        browser.execute_script("window.sameLoad = true")
        step_paused = figures["jobs"][WEB_JOB_ID]["step"]
        points = charts["mfu_points"]
        paused.touch()

        def later_step(driver: Any) -> bool:
            shown = driver.execute_script(READ_PAGE)
            job = shown["jobs"].get(WEB_JOB_ID)
            return job is not None and float(job["step"]) >= step_paused + 2

        until(browser, later_step, "the job's later steps")
        assert browser.execute_script("return window.sameLoad === true"), "the page reloaded"
        assert browser.execute_script(READ_PAGE)["charts"][WEB_JOB_ID]["mfu_points"] > points
        screenshot(browser, tmp_path / "web-live.png")

        # The buttons: each rank's memory, then a merged profile handed back as a file.
        click(browser, '[data-action="memory"]')
        until(
            browser,
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#memory tbody tr")) == 2,
            "both ranks' memory",
        )
        click(browser, '[data-action="profile"]')
        link = until(browser, lambda d: d.find_element(By.ID, "profile-file"), "the trace link")
        with urllib.request.urlopen(link.get_attribute("href"), timeout=30) as response:
            trace = json.loads(gzip.decompress(response.read()))
        ranks_traced = {p["rank"] for p in trace["otherData"]["processes"].values()}
        assert ranks_traced == {0, 1} and trace["traceEvents"]
    finally:
        paused.touch()
        stop.touch()
        try:
            if ranks is not None:
                ranks.join()
        finally:
            server.stop(grace=0.5)


@pytest.mark.timeout(180)
def test_hung_job_shows_the_hang_and_the_ranks_stacks_one_click_away(
    browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    release = tmp_path / "release"
    server = DaemonServer(
        "127.0.0.1:0", web="127.0.0.1:0", web_interval=0.25, host_interval=0.5, hang_timeout=1.0
    ).start()
    ranks: Ranks | None = None
    try:
        assert server.web is not None
        browser.get(server.web.url)
        ranks = Ranks(stall_before_all_reduce, 2, server.address, STALL_SEQ, str(release), 3)
        cells = until(
            browser,
            lambda d: d.execute_script(READ_HANG, HANG_JOB_ID),
            "the hang",
            HANG_WAIT,
        )
        assert (cells["seq"], cells["entered_ranks"], cells["missing_ranks"]) == (
            str(STALL_SEQ), "0", "1",
        )  # fmt: skip
        click(browser, f'#hangs [data-action="stacks"][data-job="{HANG_JOB_ID}"]')
        stacks = until(
            browser,
            lambda d: (
                {
                    e.get_attribute("data-rank"): e.text
                    for e in d.find_elements(By.CSS_SELECTOR, "pre.rank-stacks")
                }
                or None
            ),
            "the ranks' stacks",
            HANG_WAIT,
        )
        # Rank 1 is held before the collective; rank 0 waits inside it.
        assert "wait_for_file" in stacks["1"], stacks["1"]
        assert "all_reduce" in stacks["0"], stacks["0"]
        screenshot(browser, tmp_path / "web-hung.png")
    finally:
        release.touch()
        try:
            if ranks is not None:
                ranks.join()
        finally:
            server.stop(grace=0.5)
