"""A plugin selected by name must act: a selection that takes over nothing is reported once.

A config names the communication algorithm (`comm.algorithm`), the schedule (`schedule.name`)
and the kernel providers (`kernels.prefer`). A plugin can be selected and still do nothing —
one written against an older contract, reading its options where they no longer are, answers
`None` to everything — and the job would train on the defaults and say nothing. So, in the
first step where the selected plugin could have acted:

* the communication algorithm was offered ops of a kind its record lists (`CommAlgorithmRecord
  .ops`, top-level requests, not an algorithm's own sub-ops) and took over none of them: each
  reached the default torch.distributed implementation (`plait.core.comm.reached_default`);
* a preferred kernel provider registered an op for a device type that a model asked for (and
  no provider earlier in `kernels.prefer` answered it), and it answered none of them;
* the schedule plugin answered nothing when asked for its program (`Engine.actions`).

Then the check names the plugin, its distribution and what it was offered: a `PluginError` by
default (every rank sees the same, so every rank stops), or with `plugins.inert_selection =
"warn"` one warning from rank 0 and training goes on with the default.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING

from plait.core.comm_algorithms import is_sub_op
from plait.core.errors import InertSelection
from plait.core.records import CommRequest

if TYPE_CHECKING:
    from plait.core.comm import Comm
    from plait.core.config import PlaitConfig
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins

log = logging.getLogger("plait.plugins")

# What a single-stage job trains with when its schedule plugin answers nothing (warn policy).
FALLBACK_SCHEDULE = "accumulate"
INERT_ERROR = "error"
INERT_WARN = "warn"
HINT = (
    "A plugin selected by name must act; set plugins.inert_selection = 'warn' to train on "
    "with the default instead."
)


class CommWatch:
    """Counts the top-level requests of the kinds an algorithm takes, and how many of them
    reached the default implementation, while `active` (inside a step)."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        self.ops = frozenset(ops)
        self.active = False
        self.offered: Counter[tuple[str, str]] = Counter()
        self.defaulted = 0
        self._lock = threading.Lock()  # gradient hooks may issue from autograd's threads

    def _counts(self, request: CommRequest) -> bool:
        return self.active and request.op in self.ops and not is_sub_op(request.purpose)

    def issued(self, request: CommRequest) -> None:
        if self._counts(request):
            with self._lock:
                self.offered[(request.op, request.purpose)] += 1

    def reached_default(self, request: CommRequest) -> None:
        if self._counts(request):
            with self._lock:
                self.defaulted += 1


def _kinds(counts: Counter[tuple[str, str]]) -> str:
    return ", ".join(f"{op} ({purpose}) ×{n}" for (op, purpose), n in sorted(counts.items()))


class SelectionCheck:
    """Watches the selected comm algorithm and preferred kernel providers over the first
    steps of an engine (`step_started` / `step_ended`), and a schedule when it is built."""

    def __init__(
        self, *, config: PlaitConfig, plugins: Plugins, kernels: Kernels, comm: Comm, rank: int
    ) -> None:
        self.policy = config.plugins.inert_selection
        self.plugins = plugins
        self.kernels = kernels
        self.comm = comm
        self.rank = rank
        self.reported: list[str] = []
        self._algorithm = config.comm.algorithm
        self._algorithm_owner = ""
        self._comm_watch: CommWatch | None = None
        found = plugins.comm_algorithms().get(self._algorithm)
        if found is not None:
            self._algorithm_owner, record = found
            self._comm_watch = CommWatch(record.ops)
            comm.watch = self._comm_watch
        records = plugins.kernel_records()
        self._providers = {
            provider: owner
            for provider in kernels.prefer
            for owner, record in records
            if record.provider == provider
        }
        self._kernel_records = {
            (r.provider, r.op, device) for _, r in records for device in r.device_types
        }

    # -- steps --------------------------------------------------------------------------------

    def step_started(self) -> None:
        if self._comm_watch is not None:
            self._comm_watch.active = True

    def step_ended(self, step: int) -> None:
        """Decide what the step showed (`step`: 0-based); raises `InertSelection` under the
        default policy."""
        problems = [p for p in (self._comm_verdict(step), *self._kernel_verdicts(step)) if p]
        self._report(problems)

    def _comm_verdict(self, step: int) -> str:
        watch = self._comm_watch
        if watch is None:
            return ""
        watch.active = False
        offered = sum(watch.offered.values())
        if not offered:
            return ""  # nothing it takes was offered in this step: ask again after the next
        self._comm_watch = self.comm.watch = None  # decided, once
        if watch.defaulted < offered:
            return ""
        return (
            f"comm.algorithm = {self._algorithm!r} selects "
            f"{self.plugins.describe(self._algorithm_owner)}, but it took over none of the "
            f"{offered} ops it was offered in step {step + 1}: {_kinds(watch.offered)}; each ran "
            "on the default torch.distributed instead."
        )

    def _kernel_verdicts(self, step: int) -> list[str]:
        if not self._providers:
            return []
        chosen = self.kernels.chosen_providers()
        order = {p: i for i, p in enumerate(self.kernels.prefer)}
        verdicts = []
        for provider, owner in list(self._providers.items()):
            could = [
                key
                for key, answered_by in chosen.items()
                if (provider, key[0], key[1]) in self._kernel_records
                and key[0] not in self.kernels.overrides
                and order.get(answered_by, len(order)) >= order[provider]
            ]
            if not could:
                continue  # no op it registers was asked for yet
            del self._providers[provider]
            if any(chosen[key] == provider for key in could):
                continue
            asked = ", ".join(f"{op} on {device}/{dtype}" for op, device, dtype in sorted(could))
            verdicts.append(
                f"kernels.prefer names provider {provider!r} of {self.plugins.describe(owner)}, "
                f"but it answered none of the {len(could)} kernels it registers that were asked "
                f"for by step {step + 1}: {asked}; "
                + ", ".join(sorted({chosen[k] for k in could}))
                + " answered instead."
            )
        return verdicts

    # -- the schedule -------------------------------------------------------------------------

    def schedule_answered_nothing(self, message: str) -> None:
        """The schedule plugin answered nothing (`message` says which and what it was
        offered): raises under the default policy; warns once, for the caller to fall back."""
        self._report([message])

    # -- reporting ----------------------------------------------------------------------------

    def _report(self, problems: list[str]) -> None:
        if not problems:
            return
        if self.policy == INERT_ERROR:
            raise InertSelection(" ".join(problems) + " " + HINT)
        for problem in problems:
            if problem in self.reported:
                continue
            self.reported.append(problem)
            if self.rank == 0:  # once for the job, not once per rank
                log.warning("%s Training goes on with the default.", problem)
