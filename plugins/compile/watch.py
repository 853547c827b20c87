"""What the compiler did to the blocks, made visible: graphs, graph breaks, compile time and
recompilations, read from Dynamo's own process-wide counters.

    watch = CompileWatch(blocks=6, rank=0)
    plugins.register(watch, "compile.watch")   # its `plait_step_end` logs on rank 0:
    # once: "compiled blocks: 1 graph for 6 blocks, 0 graph breaks, 24.9 s compiling by step 1"
    # later: "compiled blocks recompiled in step 4: 0/1: tensor 'x' size mismatch at index 1…"

Which of plait's kernels the graphs kept as single custom ops (`torch.ops.plait.*`, the Triton
provider's form under the compiler) is counted by the backend the blocks compile with
(`recording`), as the graphs reach it; the first summary names them ("plait kernels as custom
ops: rms_norm ×2, attention ×1"). A provider whose torch code the compiler traced (the reference)
leaves none, and the line says nothing of them.

Dynamo counts for the whole process, so the watch keeps the values it found when it was made
and reports what changed since: a second engine in the same process reports its own compiles.
Steps 1 and 2 may compile (step 1 the first graph; step 2 a backward or a shape marked dynamic
after step 1), a compile after that is a recompilation worth a line with its cause.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.core.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from plait.core.step import StepReport

logger = logging.getLogger("plait.compile")

# Steps that may compile without it being a recompilation (see the module docstring).
WARMUP_STEPS = 2
# Where Dynamo times a frame's compile (the backend's forward included) and a backward
# compiled lazily on its first call.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


# The custom-op namespace of plait's kernels (`torch.library`'s "plait::…").
KERNEL_NAMESPACE = "plait"
# plait's custom ops in the graphs the blocks' backend was handed, by op: process-wide, as
# Dynamo's own counters are.
CUSTOM_OPS: Counter[str] = Counter()


@functools.cache
def recording(backend: str) -> Callable[[torch.fx.GraphModule, list[Any]], Any]:
    """The torch.compile backend named `backend` (Dynamo's registry), counting into `CUSTOM_OPS`
    the plait custom ops of every graph before compiling it as that backend would. One object
    per name and process: Dynamo keeps compiled code per backend, so a second engine of the same
    process reuses the first one's graphs, as it does with the backend's name."""
    from torch._dynamo import lookup_backend

    compile_graph = lookup_backend(backend)

    def record_then_compile(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        CUSTOM_OPS.update(custom_ops_in(graph))
        return compile_graph(graph, example_inputs)

    return record_then_compile


def custom_ops_in(graph: torch.fx.GraphModule) -> Counter[str]:
    """plait custom ops called by `graph`, by op name ("rms_norm")."""
    found: Counter[str] = Counter()
    for node in graph.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", "") == KERNEL_NAMESPACE:
            found[str(target).split(".")[1]] += 1
    return found


@dataclass(frozen=True, slots=True)
class CompileCounts:
    """Dynamo's counters at one moment (process-wide totals), and the plait custom ops the
    graphs held (`CUSTOM_OPS`)."""

    graphs: int
    graph_breaks: Counter[str]
    recompile_reasons: tuple[str, ...]
    compile_seconds: float
    custom_ops: Counter[str] = field(default_factory=Counter)

    @classmethod
    def now(cls) -> CompileCounts:
        from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures

        return cls(
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks=Counter(counters["graph_break"]),
            recompile_reasons=tuple(r for reasons in guard_failures.values() for r in reasons),
            compile_seconds=sum(sum(compilation_time_metrics.get(t, ())) for t in _COMPILE_TIMERS),
            custom_ops=Counter(CUSTOM_OPS),
        )

    def since(self, earlier: CompileCounts) -> CompileCounts:
        """What happened between `earlier` and this moment."""
        seen = Counter(earlier.recompile_reasons)
        new_reasons = []
        for reason in self.recompile_reasons:
            if seen[reason]:
                seen[reason] -= 1
            else:
                new_reasons.append(reason)
        return CompileCounts(
            graphs=self.graphs - earlier.graphs,
            graph_breaks=self.graph_breaks - earlier.graph_breaks,
            recompile_reasons=tuple(new_reasons),
            compile_seconds=self.compile_seconds - earlier.compile_seconds,
            custom_ops=self.custom_ops - earlier.custom_ops,
        )


# Dynamo's explanation of a break at a function it skipped names it as `<function NAME at …>`.
_FUNCTION_NAMED = re.compile(r"<function ([\w.<>]+) at 0x")


def first_step_summary(counts: CompileCounts, *, blocks: int, step: int = 1) -> str:
    """One line: graphs, graph breaks (with Dynamo's reasons) and compile time up to the first
    step that compiled."""
    breaks = sum(counts.graph_breaks.values())
    # The blocks share one forward: Dynamo compiles its code once for all of them, and a block
    # compiles a graph of its own only when a guard (a shape, a constant) tells it apart.
    line = (
        f"compiled blocks: {counts.graphs} graph{'s' if counts.graphs != 1 else ''} for "
        f"{blocks} block{'s' if blocks != 1 else ''}, {breaks} graph "
        f"break{'s' if breaks != 1 else ''}, {counts.compile_seconds:.1f} s compiling "
        f"by step {step}"
    )
    if breaks:
        reasons = "; ".join(
            f"{n}× {_break_cause(reason)}" for reason, n in counts.graph_breaks.most_common()
        )
        line += f" (breaks: {reasons})"
    if counts.custom_ops:
        kept = ", ".join(f"{op} ×{n}" for op, n in sorted(counts.custom_ops.items()))
        line += f"; plait kernels as custom ops in the graphs: {kept}"
    return line


def recompile_summary(counts: CompileCounts, *, step: int) -> str:
    """One line: the recompilations of a step after the warm-up, each with Dynamo's cause."""
    causes = "; ".join(_first_line(r) for r in counts.recompile_reasons) or (
        f"{counts.graphs} new graph(s), no guard failure recorded"
    )
    return f"compiled blocks recompiled in step {step}: {causes}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _break_cause(reason: str) -> str:
    """Dynamo's reason's first line, and the function it names when it names one (a break at
    a `torch.compiler.disable`d function says which: the tensor-parallel operators are)."""
    named = _FUNCTION_NAMED.search(reason)
    first = _first_line(reason)
    return f"{first} ({named.group(1)})" if named else first


@dataclass
class CompileWatch:
    """A plugin object: on rank 0, logs the first compiling step's summary once and every
    recompilation after the warm-up steps with its cause; `summaries` keeps the lines."""

    blocks: int
    rank: int
    baseline: CompileCounts = field(default_factory=CompileCounts.now)
    steps: int = 0
    summaries: list[str] = field(default_factory=list)
    recompilations: int = 0
    summarised: bool = False

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        del report
        self.steps += 1
        now = CompileCounts.now()
        change = now.since(self.baseline)
        if not self.summarised:
            # A first step that ran eagerly (e.g. under FLOP counting) compiles in the next one.
            if not change.graphs and self.steps < WARMUP_STEPS:
                return
            line = first_step_summary(change, blocks=self.blocks, step=self.steps)
            self.summarised = True
        elif self.steps > WARMUP_STEPS and (change.graphs or change.recompile_reasons):
            self.recompilations += max(change.graphs, len(change.recompile_reasons))
            line = recompile_summary(change, step=self.steps)
        else:
            line = None
        self.baseline = now
        if line is None:
            return
        self.summaries.append(line)
        if self.rank == 0:
            # NOTE: warning, like the checkpointer's "resumed from": `plait train` installs no
            # logging handler, and Python's last-resort handler prints warnings and above only.
            logger.warning(line)
