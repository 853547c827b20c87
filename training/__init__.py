"""The training loop behind `plait train`, in a room of its own (below the command line, above
the engine and the plugins it assembles).

- `loop.py`: `run_training`, top to bottom: engine, data, the step's source, the components
  asked after each step, the summary.
- `steps.py`: where a step comes from — the engine's `train_step`, or a fault-tolerant replica
  group's step tried until the quorum commits it.
- `data.py`: this rank's training and held-out batches; `validation.py`: the held-out loss.
- `run_records.py`: metrics.jsonl, TensorBoard events and the resolved config under
  `train.run_dir`; `launch_errors.py`: a failed rank's error for torchrun's report.
- `graceful_stop.py`: SIGTERM / SIGINT / SIGUSR1 agreed by every rank, then a save.
- `progress.py`, `banner.py`, `summary.py`, `output.py`, `rank_notices.py`: what rank 0 prints
  (and where: a terminal or a log).
"""
