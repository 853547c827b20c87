"""How a model plait did not write is cut into stages: which family it is, where its blocks are.

Three kinds of model are pipelined:

- plait's built-in models (`split.check_splittable`), cut by `split.build_chunk` as before;
- `transformers` causal LMs of the Llama family (Llama, Mistral, Qwen2) and GPT-2, by the
  stage adapters of `hf_stages`;
- any other model whose forward is a plain chain of module calls, each taking the previous
  one's output alone — `x = embed(x); for block in blocks: x = block(x); return head(x)` —
  found by tracing the forward with `torch.fx` (nothing runs). The modules called before the
  first block go to the first stage, those after the last block to the last; the blocks are
  the model's repeated blocks (`plait.core.blocks`, or `pipeline.blocks`). With
  `pipeline.split_points` and no repeated blocks, every module of the chain is a unit and the
  stages begin at the named ones.

Anything else is refused with what was found and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx, nn

from plait.core.blocks import find_block_container
from plait.core.errors import ConfigError
from plait.plugins.pipeline.hf_stages import GPT2_FAMILY, LLAMA_FAMILY, GPT2Stage, LlamaFamilyStage
from plait.plugins.pipeline.split import CROSS_ENTROPY_FLOPS_PER_LOGIT, Balance, module_cost
from plait.plugins.pipeline.stages import ChainStage, ModelStage, StageParts

Named = tuple[tuple[str, nn.Module], ...]
SUPPORTED = (
    "transformers causal LMs of the llama, mistral, qwen2 and gpt2 families, or a model whose "
    "forward is a plain chain x = module(x) (embed → blocks → head)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelAdapter:
    """A model seen as (before, blocks, after): what each stage is built from."""

    family: str
    stage_cls: type[ModelStage]
    before: Named
    blocks: Named  # full module names, in the order the forward calls them
    after: Named
    shared: Named
    hidden_size: int

    def costs(self, balance: Balance) -> tuple[float, list[float], float]:
        """(embeddings, per block, head) cost per training token, as `split.unit_costs`."""
        embeddings = sum(module_cost(m, balance) for _, m in self.before)
        blocks = [module_cost(m, balance) for _, m in self.blocks]
        head = sum(module_cost(m, balance) for _, m in self.after)
        if balance == "flops":
            head += sum(
                CROSS_ENTROPY_FLOPS_PER_LOGIT * m.out_features
                for _, m in self.after[-1:]
                if isinstance(m, nn.Linear)
            )
        return embeddings, blocks, head

    def stage(
        self, model: nn.Module, block_names: Sequence[str], *, first: bool, last: bool
    ) -> ModelStage:
        """The stage holding `block_names` (and the embeddings / head when first / last)."""
        keep = set(block_names)
        parts = StageParts(
            before=self.before if first else (),
            blocks=tuple((n, m) for n, m in self.blocks if n in keep),
            after=self.after if last else (),
            shared=self.shared,
            first=first,
            last=last,
        )
        return self.stage_cls(model, parts)


def adapter_for(
    model: nn.Module, *, blocks_path: str, split_points: Sequence[str], hidden_size: int
) -> ModelAdapter:
    """The adapter of `model`, or a `ConfigError` naming what was found."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in LLAMA_FAMILY and _has(model, "model.embed_tokens", "model.layers", "lm_head"):
        decoder = model.model  # type: ignore[union-attr]
        return ModelAdapter(
            family=model_type,
            stage_cls=LlamaFamilyStage,
            before=(("model.embed_tokens", decoder.embed_tokens),),
            blocks=_named("model.layers", decoder.layers),
            after=(("model.norm", decoder.norm), ("lm_head", model.lm_head)),
            shared=(("model.rotary_emb", decoder.rotary_emb),),
            hidden_size=model.config.hidden_size,  # type: ignore[union-attr]
        )
    if model_type in GPT2_FAMILY and _has(model, "transformer.wte", "transformer.h", "lm_head"):
        transformer = model.transformer  # type: ignore[union-attr]
        return ModelAdapter(
            family=model_type,
            stage_cls=GPT2Stage,
            before=(
                ("transformer.wte", transformer.wte),
                ("transformer.wpe", transformer.wpe),
                ("transformer.drop", transformer.drop),
            ),
            blocks=_named("transformer.h", transformer.h),
            after=(("transformer.ln_f", transformer.ln_f), ("lm_head", model.lm_head)),
            shared=(),
            hidden_size=model.config.n_embd,  # type: ignore[union-attr]
        )
    return _chain_adapter(
        model, blocks_path=blocks_path, split_points=split_points, hidden_size=hidden_size
    )


def _has(model: nn.Module, *paths: str) -> bool:
    try:
        for path in paths:
            model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _named(path: str, container: nn.Module) -> Named:
    return tuple((f"{path}.{key}", block) for key, block in container.named_children())


def _chain_adapter(
    model: nn.Module, *, blocks_path: str, split_points: Sequence[str], hidden_size: int
) -> ModelAdapter:
    what = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None:
        # A transformers model of another family: its forward is not a chain, and guessing
        # what it computes around its blocks would silently train a different model.
        raise ConfigError(
            f"the 'pipeline' strategy cannot split {what} (transformers model_type "
            f"{model_type!r}): plait pipelines {SUPPORTED}; use parallel.pp = 1 with this model"
        )
    container: tuple[str, nn.Module] | None
    try:
        container = find_block_container(model, blocks_path, field="pipeline.blocks")
    except ConfigError:
        if blocks_path:
            raise  # names the configured path and what is there
        if not split_points:
            raise ConfigError(
                f"the 'pipeline' strategy found no repeated blocks in {what} (no ModuleList of "
                f"one block class); name the container with pipeline.blocks, or the modules "
                f"stages begin with in pipeline.split_points; plait pipelines {SUPPORTED}"
            ) from None
        container = None
    block_names = (
        {f"{container[0]}.{k}" for k, _ in container[1].named_children()} if container else set()
    )
    chain = trace_chain(model, leaves=block_names, split_points=split_points)
    if container is None:
        before, blocks, after = (), chain, ()
    else:
        in_order = [f"{container[0]}.{key}" for key, _ in container[1].named_children()]
        positions = [i for i, (name, _) in enumerate(chain) if name in block_names]
        called = [chain[i][0] for i in positions]
        if called != in_order or positions != list(range(positions[0], positions[-1] + 1)):
            raise ConfigError(
                f"{what}.forward does not call the blocks of {container[0]!r} one after the "
                f"other (calls: {[n for n, _ in chain]}); plait pipelines {SUPPORTED}"
            )
        before = chain[: positions[0]]
        blocks = chain[positions[0] : positions[-1] + 1]
        after = chain[positions[-1] + 1 :]
    return ModelAdapter(
        family="chain",
        stage_cls=ChainStage,
        before=before,
        blocks=blocks,
        after=after,
        shared=(),
        hidden_size=hidden_size or _infer_hidden_size(model, before or blocks[:1], what),
    )


def trace_chain(model: nn.Module, *, leaves: set[str], split_points: Sequence[str]) -> Named:
    """The modules `model.forward` calls, in order, if it is a plain chain `x = module(x)`."""
    ancestors = {
        p.rsplit(".", i)[0] for p in (*leaves, *split_points) for i in range(1, p.count(".") + 1)
    }

    class ChainTracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
            return qualified_name not in ancestors or qualified_name in leaves

    what = type(model).__name__
    try:
        graph = ChainTracer().trace(model)
    except Exception as exc:  # any tracing failure means "not a plain chain"
        raise ConfigError(
            f"{what}.forward cannot be traced as a chain of module calls ({type(exc).__name__}: "
            f"{exc}); plait pipelines {SUPPORTED}"
        ) from None
    chain: list[tuple[str, nn.Module]] = []
    previous: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise ConfigError(
                    f"{what}.forward takes several inputs; plait pipelines {SUPPORTED}"
                )
            previous = node
        elif node.op == "call_module" and node.args == (previous,) and not node.kwargs:
            chain.append((str(node.target), model.get_submodule(str(node.target))))
            previous = node
        elif node.op == "output" and node.args == (previous,) and chain:
            return tuple(chain)
        else:
            target = getattr(node.target, "__name__", node.target)
            raise ConfigError(
                f"{what}.forward is not a plain chain x = module(x): after "
                f"{[n for n, _ in chain] or 'its input'} it does {node.op} {target!r}; move "
                "that computation inside one of its modules (the embedding, a block or the "
                f"head) so stages can be cut between them; plait pipelines {SUPPORTED}"
            )
    raise ConfigError(f"{what}.forward returns nothing plait can pipeline")


def _infer_hidden_size(model: nn.Module, first: Named, what: str) -> int:
    """The width of the hidden states between stages: the embedding's, else the config's."""
    for _, module in first:
        for sub in module.modules():
            if isinstance(sub, nn.Embedding):
                return sub.embedding_dim
    config = getattr(model, "config", None)
    for field in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            return value
    raise ConfigError(
        f"pipeline: cannot tell the width of {what}'s hidden states between stages (no "
        "nn.Embedding before its blocks, no config.hidden_size); set pipeline.hidden_size"
    )
