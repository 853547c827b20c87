"""The daemon's analysis layer: what the store's windows mean, as plain dataclasses.

No gRPC or protobuf here. The servicer (`plait.daemon.service`) translates these records into
`plait.v1` messages, and the exporters publish points built from the same records
(`plait.daemon.points`), so an RPC, a scrape and an upstream export report the same numbers.
Every function that reads windows expects the store's lock to be held; `Analyst` takes it.

**Rank status**, for each rank window of a job:

* `superseded`: not in the job's current world (another world size, or a restart formed a new
  world since the rank was last heard from; `plait.daemon.store.JobWorlds`);
* `ended`: said its run ended (`plait.job.end`);
* `stale`: silent (no span or metric point) for longer than `StalePolicy.after_seconds` of its
  own median step time: max(`step_multiple` × median step, `floor_seconds`), at most
  `ceiling_seconds`;
* `live`: otherwise.

**Job state**: `failed` when a rank of the current world ended with outcome `failed`; else
`running` while a rank of it is live; else `finished` when every rank of it ended `finished`;
else `stale` (every rank silent without saying it ended: killed, crashed or cut off).

Job figures (MFU, throughput, step time) count the live and ended ranks of the current world;
stale and superseded ranks are left out. Steps are shown as the trainer numbers them: the step
a rank sends as `plait.step` (0-based) plus one, i.e. steps completed; 0 means none yet.

**Replica groups.** A fault-tolerant job's replica groups are worlds of their own (each with its
ranks 0..n-1, its worlds and restarts) sharing the job id: rank status is decided within the
rank's group, and the job's figures add the groups' (achieved and peak FLOP/s, tokens/s; the
slowest group's step time), so a group whose ranks went stale — it left — drops out of the
job's MFU. The job runs while any group does: one group failing is what fault tolerance is for.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from plait.daemon import mfu
from plait.daemon import telemetry_schema as schema
from plait.daemon.bottleneck import (
    RankBreakdown,
    RankContext,
    advice,
    expert_load_advice,
    job_dominant,
)
from plait.daemon.bottleneck import rank_breakdown as summarise_steps
from plait.daemon.checkpoint_log import CheckpointLog, JobCheckpointFigures, checkpoint_figures
from plait.daemon.config import (
    DEFAULT_METRICS_WINDOW_STEPS,
    DEFAULT_STALE_CEILING_SECONDS,
    DEFAULT_STALE_FLOOR_SECONDS,
    DEFAULT_STALE_STEP_MULTIPLE,
)
from plait.daemon.decoder import MAX_WIRE_STEP
from plait.daemon.host import HostSample
from plait.daemon.store import JobWorlds, RankWindow, TelemetryStore
from plait.daemon.stragglers import RankTiming, StragglerScore, score_ranks

RANK_LIVE = "live"
RANK_STALE = "stale"
RANK_ENDED = "ended"
RANK_SUPERSEDED = "superseded"

JOB_RUNNING = "running"
JOB_FINISHED = "finished"
JOB_FAILED = "failed"
JOB_STALE = "stale"
JOB_STATES = (JOB_RUNNING, JOB_FINISHED, JOB_FAILED, JOB_STALE)


@dataclass(frozen=True, slots=True)
class StalePolicy:
    """When a silent rank counts as stale: a few of its own step times, bounded."""

    floor_seconds: float = DEFAULT_STALE_FLOOR_SECONDS
    step_multiple: float = DEFAULT_STALE_STEP_MULTIPLE
    ceiling_seconds: float = DEFAULT_STALE_CEILING_SECONDS

    def __post_init__(self) -> None:
        if not 0 < self.floor_seconds <= self.ceiling_seconds:
            raise ValueError(
                f"stale floor_seconds must be > 0 and <= ceiling_seconds "
                f"({self.ceiling_seconds}), got {self.floor_seconds}"
            )
        if self.step_multiple < 0:
            raise ValueError(f"stale step_multiple must be >= 0, got {self.step_multiple}")

    def after_seconds(self, median_step_seconds: float) -> float:
        wanted = max(self.step_multiple * median_step_seconds, self.floor_seconds)
        return min(wanted, self.ceiling_seconds)


def median_step_seconds(window: RankWindow, count: int) -> float:
    steps = window.last_steps(count)
    return statistics.median(s.seconds for s in steps) if steps else 0.0


def shown_step(wire_step: int | None) -> int:
    """The trainer's numbering (steps completed) of a 0-based wire step; 0 for none.

    NOTE: the decoder keeps wire steps below `MAX_WIRE_STEP`; the bound here holds whatever
    reached the store, since the result goes to int64 fields of every report."""
    if wire_step is None:
        return 0
    return min(wire_step, MAX_WIRE_STEP) + 1


# --------------------------------------------------------------------------------------------
# ranks and jobs: status and state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankState:
    window: RankWindow
    status: str
    silent_seconds: float
    stale_after_seconds: float

    @property
    def counted(self) -> bool:
        """In the job's figures: a live or ended rank of the current world."""
        return self.status in (RANK_LIVE, RANK_ENDED)


@dataclass(frozen=True, slots=True)
class WorldHistory:
    sizes: tuple[int, ...]  # the kept worlds' sizes, oldest first
    restarts: int  # worlds formed after the first one
    current_size: int
    attempt: int  # the current world's restart attempt
    started_step: int  # first step of the current world, trainer numbering (0: none yet)
    started_ns: int = 0  # when this daemon first heard from the current world (Unix ns)
    last_heard_ns: int = 0  # when it last heard from a rank of the current world (Unix ns)


@dataclass(frozen=True, slots=True)
class JobState:
    job_id: str
    state: str
    ranks: tuple[RankState, ...]  # every window of the job, by group and rank (all of them)
    world: WorldHistory
    # Each replica group's own state and world, by group index (empty: not fault tolerant).
    groups: Mapping[int, tuple[str, WorldHistory]] = field(default_factory=dict)

    @property
    def counted(self) -> list[RankState]:
        return [r for r in self.ranks if r.counted]

    @property
    def stale(self) -> list[RankState]:
        return [r for r in self.ranks if r.status == RANK_STALE]


def rank_state(
    window: RankWindow, worlds: JobWorlds, now_ns: int, policy: StalePolicy, window_steps: int
) -> RankState:
    silent = max(now_ns - window.last_seen_ns, 0) / 1e9
    after = policy.after_seconds(median_step_seconds(window, window_steps))
    if not worlds.is_member(window):
        status = RANK_SUPERSEDED
    elif window.outcome:
        status = RANK_ENDED
    elif silent > after:
        status = RANK_STALE
    else:
        status = RANK_LIVE
    return RankState(window, status, silent, after)


def fault_tolerant_state(group_states: Iterable[str]) -> str:
    """A fault-tolerant job runs while any replica group runs; then failed, finished, stale."""
    states = set(group_states)
    for state in (JOB_RUNNING, JOB_FAILED, JOB_FINISHED):
        if state in states:
            return state
    return JOB_STALE


def world_history(worlds: JobWorlds, ranks: Sequence[RankState]) -> WorldHistory:
    firsts = [
        r.window.first_step
        for r in ranks
        if r.status != RANK_SUPERSEDED and r.window.first_step is not None
    ]
    members = [r.window for r in ranks if r.status != RANK_SUPERSEDED]
    return WorldHistory(
        sizes=tuple(w.size for w in worlds.worlds),
        restarts=worlds.changes,
        current_size=worlds.current.size,
        attempt=worlds.current.attempt,
        started_step=shown_step(min(firsts)) if firsts else 0,
        started_ns=worlds.current.started_ns,
        last_heard_ns=max((w.last_seen_ns for w in members), default=0),
    )


def joined_history(histories: Sequence[WorldHistory]) -> WorldHistory:
    """The job's world made of its replica groups' worlds: their sizes add up, as do their
    restarts; it started when its newest group world did."""
    started = [h.started_step for h in histories if h.started_step]
    return WorldHistory(
        sizes=tuple(size for h in histories for size in h.sizes),
        restarts=sum(h.restarts for h in histories),
        current_size=sum(h.current_size for h in histories),
        attempt=max(h.attempt for h in histories),
        started_step=min(started) if started else 0,
        started_ns=max(h.started_ns for h in histories),
        last_heard_ns=max(h.last_heard_ns for h in histories),
    )


def job_state_of(ranks: Sequence[RankState]) -> str:
    members = [r for r in ranks if r.status != RANK_SUPERSEDED]
    if any(r.window.outcome == schema.JOB_OUTCOME_FAILED for r in members):
        return JOB_FAILED
    if any(r.status == RANK_LIVE for r in members):
        return JOB_RUNNING
    if members and all(r.window.outcome == schema.JOB_OUTCOME_FINISHED for r in members):
        return JOB_FINISHED
    return JOB_STALE


def job_states(
    store: TelemetryStore,
    *,
    now_ns: int,
    policy: StalePolicy,
    window_steps: int = DEFAULT_METRICS_WINDOW_STEPS,
    job_id: str = "",
) -> list[JobState]:
    """Every job's (or `job_id`'s) state, ranks and worlds; call with the store's lock held."""
    by_job: dict[str, list[RankWindow]] = {}
    for window in store.windows(job_id):
        by_job.setdefault(window.identity.job_id, []).append(window)
    out = []
    for job, windows in by_job.items():
        by_group: dict[int, list[RankWindow]] = {}
        for window in windows:
            by_group.setdefault(window.identity.replica_group, []).append(window)
        ranks: list[RankState] = []
        groups: dict[int, tuple[str, WorldHistory]] = {}
        for group, group_windows in sorted(by_group.items()):
            worlds = store.worlds(job, group)
            states = [rank_state(w, worlds, now_ns, policy, window_steps) for w in group_windows]
            ranks.extend(states)
            groups[group] = (job_state_of(states), world_history(worlds, states))
        if set(groups) == {schema.NO_REPLICA_GROUP}:
            state, world = groups.pop(schema.NO_REPLICA_GROUP)
        else:
            state = fault_tolerant_state(s for s, _ in groups.values())
            world = joined_history([h for _, h in groups.values()])
        out.append(JobState(job, state, tuple(ranks), world, groups))
    return out


def visible(jobs: Iterable[JobState], *, include_finished: bool, job_id: str) -> list[JobState]:
    """Finished jobs are hidden unless asked for (by `include_finished`, or by name)."""
    return [j for j in jobs if include_finished or job_id or j.state != JOB_FINISHED]


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """What the host and GPU collectors say about a rank's process (-1: unknown)."""

    cpu_percent: float = -1.0
    memory_rss_bytes: int = -1
    device_utilization: float = -1.0


@dataclass(frozen=True, slots=True)
class RankFigures:
    job_id: str
    rank: int
    host: str
    status: str
    silent_seconds: float
    restart_attempt: int
    step: int  # trainer numbering; 0: none yet
    window_steps: int
    step_seconds: float
    tokens_per_second: float
    model_flops_per_second: float
    peak_flops: float
    mfu: float
    data_wait_seconds: float
    comm_seconds: float
    comm_share: float
    loss: float
    device_memory_bytes: int
    usage: ProcessUsage
    otel_metrics: Mapping[str, float]
    # Bytes this rank sent per step inside its node and across nodes (mean over the window).
    comm_bytes_intra_node: int = 0
    comm_bytes_inter_node: int = 0
    # Bytes sent since the daemon first heard the rank (what Prometheus counts).
    comm_bytes_intra_node_total: int = 0
    comm_bytes_inter_node_total: int = 0
    replica_group: int = -1  # the rank's replica group (-1: none)


def device_index(device: str) -> int | None:
    """ "cuda:3" -> 3 (NVML and CUDA agree on indices with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return int(index) if index.isdigit() else 0
    return None


def process_usage(
    window: RankWindow, host: HostSample, gpu_utilization: Mapping[int, float]
) -> ProcessUsage:
    identity = window.identity
    process = host.processes.get(identity.key)
    index = device_index(identity.device) if identity.host == host.hostname else None
    return ProcessUsage(
        cpu_percent=process.cpu_percent if process else -1.0,
        memory_rss_bytes=process.rss_bytes if process else -1,
        device_utilization=gpu_utilization.get(index, -1.0) if index is not None else -1.0,
    )


def rank_figures(state: RankState, window_steps: int, usage: ProcessUsage) -> RankFigures:
    window = state.window
    identity = window.identity
    steps = window.last_steps(window_steps)
    rate = mfu.rank_throughput(window.samples(window_steps), identity.peak_flops)
    comm = sum(window.comm_seconds(s.step) for s in steps) / len(steps) if steps else 0.0
    last = steps[-1] if steps else None
    intra, inter = window.comm_link_bytes(window_steps)
    return RankFigures(
        job_id=identity.job_id,
        rank=identity.rank,
        host=identity.host,
        status=state.status,
        silent_seconds=state.silent_seconds,
        restart_attempt=identity.restart_attempt,
        step=shown_step(last.step if last else None),
        window_steps=rate.steps,
        step_seconds=rate.step_seconds,
        tokens_per_second=rate.tokens_per_second,
        model_flops_per_second=rate.model_flops_per_second,
        peak_flops=identity.peak_flops,
        mfu=rate.mfu,
        data_wait_seconds=sum(s.data_wait_seconds for s in steps) / len(steps) if steps else 0.0,
        comm_seconds=comm,
        comm_share=comm / rate.step_seconds if rate.step_seconds > 0 else 0.0,
        loss=last.loss if last else 0.0,
        # The decoder bounds this metric, so the conversion cannot fail.
        device_memory_bytes=int(window.metrics.get(schema.METRIC_DEVICE_MEMORY_USED, -1)),
        usage=usage,
        otel_metrics=dict(window.metrics),
        comm_bytes_intra_node=intra,
        comm_bytes_inter_node=inter,
        comm_bytes_intra_node_total=window.comm_bytes_intra_node_total,
        comm_bytes_inter_node_total=window.comm_bytes_inter_node_total,
        replica_group=identity.replica_group,
    )


@dataclass(frozen=True, slots=True)
class ExpertLayerFigures:
    """One MoE layer's load: the last step with a report, and the mean over the window."""

    layer: str
    experts: int
    step: int  # trainer numbering
    tokens: int  # kept assignments, whole job, last step
    max_tokens: int
    mean_tokens: float
    imbalance: float  # max / mean, last step (1.0: balanced)
    dropped: int  # assignments dropped over capacity, last step
    dropped_fraction: float  # dropped / (kept + dropped), last step
    mean_imbalance: float  # over the window's steps
    steps: int


def expert_load_figures(
    windows: Sequence[RankWindow], window_steps: int
) -> list[ExpertLayerFigures]:
    """From the lowest counted rank that reports expert loads (every rank reports the job's)."""
    source = next((w for w in windows if w.expert_loads), None)
    if source is None:
        return []
    steps = list(source.expert_loads.items())[-window_steps:]
    last_step, last = steps[-1]
    out = []
    for layer, load in sorted(last.items()):
        tokens = load.tokens_per_expert
        total = sum(tokens)
        mean = total / len(tokens)
        history = [
            _imbalance(by_layer[layer].tokens_per_expert)
            for _, by_layer in steps
            if layer in by_layer
        ]
        out.append(
            ExpertLayerFigures(
                layer=layer,
                experts=len(tokens),
                step=shown_step(last_step),
                tokens=total,
                max_tokens=max(tokens),
                mean_tokens=mean,
                imbalance=_imbalance(tokens),
                dropped=load.dropped,
                dropped_fraction=load.dropped / (total + load.dropped)
                if total + load.dropped
                else 0.0,
                mean_imbalance=sum(history) / len(history),
                steps=len(history),
            )
        )
    return out


def _imbalance(tokens: Sequence[int]) -> float:
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else 0.0


@dataclass(frozen=True, slots=True)
class JobFigures:
    job_id: str
    state: str
    world: WorldHistory
    ranks_reporting: int  # live or ended ranks of the current world
    ranks_stale: int
    step: int  # trainer numbering
    window_steps: int
    step_seconds: float
    tokens_per_second: float
    model_flops_per_second: float
    peak_flops: float
    mfu: float
    expert_load: tuple[ExpertLayerFigures, ...] = ()
    # Bytes the reporting ranks sent per step inside their nodes and across nodes (sums).
    comm_bytes_intra_node: int = 0
    comm_bytes_inter_node: int = 0
    # The save being written and the last one (`plait.daemon.checkpoint_log`); None: none sent.
    checkpoints: JobCheckpointFigures | None = None


def group_throughputs(windows: Sequence[RankWindow], window_steps: int) -> list[mfu.Throughput]:
    """Each replica group's throughput over its own steps (one group outside fault tolerance):
    a group is a world of its own, whose ranks report its steps."""
    by_group: dict[int, list[RankWindow]] = {}
    for w in windows:
        by_group.setdefault(w.identity.replica_group, []).append(w)
    return [
        mfu.job_throughput(
            {w.identity.rank: w.samples(window_steps) for w in group},
            {w.identity.rank: w.identity.peak_flops for w in group},
            window_steps=window_steps,
        )
        for _, group in sorted(by_group.items())
    ]


def joined_throughput(rates: Sequence[mfu.Throughput]) -> mfu.Throughput:
    """The job's throughput from its groups': achieved and peak FLOP/s and tokens/s add up,
    the slowest group's step time counts, over the fewest steps any group has."""
    if len(rates) == 1:
        return rates[0]
    if not rates:
        return mfu.EMPTY
    achieved = sum(r.model_flops_per_second for r in rates)
    peak = sum(r.peak_flops for r in rates)
    return mfu.Throughput(
        steps=min((r.steps for r in rates if r.steps), default=0),
        step_seconds=max(r.step_seconds for r in rates),
        tokens_per_second=sum(r.tokens_per_second for r in rates),
        model_flops_per_second=achieved,
        peak_flops=peak,
        mfu=mfu.mfu(achieved, peak),
    )


def job_figures(
    job: JobState,
    window_steps: int,
    checkpoint_log: CheckpointLog | None = None,
    now_ns: int = 0,
) -> JobFigures:
    windows = [r.window for r in job.counted]
    rate = joined_throughput(group_throughputs(windows, window_steps))
    last = [w.last_steps(1)[0].step for w in windows if w.steps]
    link_bytes = [w.comm_link_bytes(window_steps) for w in windows]
    return JobFigures(
        job_id=job.job_id,
        state=job.state,
        world=job.world,
        ranks_reporting=len(windows),
        ranks_stale=len(job.stale),
        step=shown_step(max(last)) if last else 0,
        window_steps=rate.steps,
        step_seconds=rate.step_seconds,
        tokens_per_second=rate.tokens_per_second,
        model_flops_per_second=rate.model_flops_per_second,
        peak_flops=rate.peak_flops,
        mfu=rate.mfu,
        expert_load=tuple(expert_load_figures(windows, window_steps)),
        comm_bytes_intra_node=sum(links[0] for links in link_bytes),
        comm_bytes_inter_node=sum(links[1] for links in link_bytes),
        checkpoints=checkpoint_figures(
            checkpoint_log, now_ns=now_ns, running=job.state == JOB_RUNNING
        ),
    )


@dataclass(frozen=True, slots=True)
class MetricsView:
    ranks: list[RankFigures]
    jobs: list[JobFigures]


def metrics_view(
    jobs: Sequence[JobState],
    *,
    window_steps: int,
    host: HostSample,
    gpu_utilization: Mapping[int, float],
    include_superseded: bool,
    checkpoint_logs: Mapping[str, CheckpointLog | None] | None = None,
    now_ns: int = 0,
) -> MetricsView:
    """Rank and job figures of `jobs` (superseded ranks only when asked for); the jobs'
    checkpoints from `checkpoint_logs` as they stand at `now_ns`."""
    ranks = [
        rank_figures(r, window_steps, process_usage(r.window, host, gpu_utilization))
        for job in jobs
        for r in job.ranks
        if include_superseded or r.status != RANK_SUPERSEDED
    ]
    logs = checkpoint_logs or {}
    return MetricsView(
        ranks=ranks,
        jobs=[job_figures(j, window_steps, logs.get(j.job_id), now_ns) for j in jobs],
    )


# --------------------------------------------------------------------------------------------
# bottlenecks and stragglers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankAnalysis:
    """One rank's bottleneck breakdown over a window, with what advice and scoring need."""

    job_id: str
    rank: int
    host: str
    breakdown: RankBreakdown
    context: RankContext
    replica_group: int = -1  # in a fault-tolerant job: the group that numbers `rank`

    @property
    def advice(self) -> str:
        return full_advice(self.breakdown, self.context) if self.breakdown.steps else ""


def full_advice(breakdown: RankBreakdown, context: RankContext) -> str:
    """Advice for the dominant class, then the expert load's when it is uneven."""
    return " ".join(
        t for t in (advice(breakdown, context), expert_load_advice(breakdown, context)) if t
    )


def expert_context(figures: Sequence[ExpertLayerFigures]) -> dict[str, object]:
    """The RankContext fields about expert load: the worst layer's mean imbalance and drops."""
    if not figures:
        return {}
    worst = max(figures, key=lambda f: f.mean_imbalance)
    return {
        "expert_imbalance": worst.mean_imbalance,
        "expert_layer": worst.layer,
        "expert_dropped_fraction": max(f.dropped_fraction for f in figures),
    }


def analyse(jobs: Sequence[JobState], window_steps: int) -> list[RankAnalysis]:
    """Breakdowns of the counted ranks of `jobs`."""
    out = []
    for job in jobs:
        windows = [r.window for r in job.counted]
        moe = expert_context(expert_load_figures(windows, window_steps))
        for w in windows:
            out.append(
                RankAnalysis(
                    job_id=w.identity.job_id,
                    rank=w.identity.rank,
                    host=w.identity.host,
                    breakdown=summarise_steps(w.breakdowns(window_steps)),
                    context=RankContext(
                        degrees=w.identity.degrees,
                        comm_bytes_by_purpose=w.comm_volume(window_steps),
                        device=w.identity.device,
                        compute_dtype=w.identity.compute_dtype,
                        comm_link_bytes=w.comm_link_bytes(window_steps),
                        **moe,  # type: ignore[arg-type]
                    ),
                    replica_group=w.identity.replica_group,
                )
            )
    return out


def straggler_scores(analyses: Sequence[RankAnalysis], threshold: float) -> list[StragglerScore]:
    return score_ranks(
        (
            RankTiming(
                job_id=a.job_id,
                rank=a.rank,
                host=a.host,
                steps=a.breakdown.steps,
                median_step_seconds=a.breakdown.median_step_seconds,
                median_compute_seconds=a.breakdown.median_compute_seconds,
                replica_group=a.replica_group,
            )
            for a in analyses
        ),
        threshold,
    )


@dataclass(frozen=True, slots=True)
class BottleneckView:
    ranks: list[RankAnalysis]
    dominant: str
    advice: str
    stragglers: list[StragglerScore] = field(default_factory=list)


def bottleneck_view(
    jobs: Sequence[JobState], *, window_steps: int, threshold: float
) -> BottleneckView:
    analyses = analyse(jobs, window_steps)
    overall = job_dominant(a.breakdown for a in analyses)
    dominant = text = ""
    if overall.steps:
        context = analyses[0].context if analyses else RankContext()
        # The job's traffic, not rank 0's: in a flat ring some ranks send only inside a node.
        job_bytes = (
            sum(a.context.comm_link_bytes[0] for a in analyses),
            sum(a.context.comm_link_bytes[1] for a in analyses),
        )
        context = dataclasses.replace(context, comm_link_bytes=job_bytes)
        dominant, text = overall.dominant, full_advice(overall, context)
    return BottleneckView(analyses, dominant, text, straggler_scores(analyses, threshold))
