"""The batches a training run reads: this rank's share of the training split and, when
`train.eval_every` is set, of the held-out split (replica groups of a fault-tolerant job each
read their own share of the global batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.core.errors import ConfigError

if TYPE_CHECKING:
    from plait.core.config import DataSection, PlaitConfig
    from plait.core.engine import Engine
    from plait.plugins.data import TokenBatches


@dataclass(frozen=True, slots=True)
class TrainingData:
    train: TokenBatches
    validation: TokenBatches | None  # None: no held-out split (train.eval_every = 0)

    @classmethod
    def build(cls, engine: Engine, config: PlaitConfig) -> TrainingData:
        from plait.core.preflight import validation_data_problems
        from plait.plugins.data import build_batches
        from plait.plugins.fault_tolerance.config import fault_tolerance_config
        from plait.plugins.fault_tolerance.data_share import replica_data_coordinates
        from plait.training.validation import check_validation_layout

        train = config.train
        problems = validation_data_problems(config)
        if problems:
            raise ConfigError("; ".join(problems))
        if train.eval_every:
            check_validation_layout(engine)
        # A validation directory of its own replaces the held-out end of data.path.
        own_validation = bool(config.data.validation_path)
        holdout = train.eval_fraction if train.eval_every and not own_validation else 0.0
        mesh = engine.mesh
        data_rank, data_size = replica_data_coordinates(
            dp_rank=mesh.coordinate("dp"),
            dp_size=mesh.size("dp"),
            settings=fault_tolerance_config(config),
        )

        def batches(data: DataSection, split: str) -> TokenBatches:
            return build_batches(
                data,
                seq_len=data.seq_len,
                global_batch_size=train.global_batch_size,
                dp_rank=data_rank,
                dp_size=data_size,
                seed=train.seed,
                holdout=holdout,
                split=split,
            )

        training = batches(config.data, "train")
        validation = None
        if own_validation and train.eval_every:
            validation = batches(
                config.data.model_copy(update={"path": config.data.validation_path}), "train"
            )
        elif holdout:
            validation = batches(config.data, "validation")
        for split in (training, validation):
            if split is not None:
                check_vocabulary(engine, split.vocab_size)
        return cls(train=training, validation=validation)


def check_vocabulary(engine: Engine, data_vocab: int) -> None:
    """Token ids beyond the model's embedding would fail inside the first forward."""
    model_vocab = getattr(engine.model_config, "vocab_size", None)
    if isinstance(model_vocab, int) and data_vocab > model_vocab:
        raise ConfigError(
            f"the data's tokenizer has {data_vocab:,} ids but the model's vocabulary is "
            f"{model_vocab:,}; set model.overrides.vocab_size = {data_vocab} (or more)"
        )
