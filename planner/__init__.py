"""`plait plan`: choose a parallel layout from a memory model and a calibrated time model.

One concern per module: `model_shape` (what is trained), `devices` (what it runs on),
`layouts` (the candidates and their rules), `memory_model`, `schedule_model` (pipeline
in-flight micro-batches and makespan from the schedule simulator), `comm_model` (α–β links and
their calibration), `time_model`, `search`, `published` (runs the planner must recover),
`daemon_client` and `explain` (learning from a finished run), `auto` (`plait train --auto`).
"""

from plait.planner.layouts import Job, Layout, SearchSpace
from plait.planner.search import Candidate, PlanResult, plan, price

__all__ = ["Candidate", "Job", "Layout", "PlanResult", "SearchSpace", "plan", "price"]
