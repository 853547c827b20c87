# A user's FSDP2 script: fully_shard per block, then the root; plait's two lines added. Its
# loader takes 20 ms per batch (reading from storage, say), outside the observed step.
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import plait

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
vocab, dim, seq_len, batch_size, steps = 512, 256, 64, 8, 20


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = Net()
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
observer = plait.observe(model, optimizer=optimizer)


def batches(generator: torch.Generator):
    while True:
        time.sleep(0.02)
        yield torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)


loader = batches(torch.Generator().manual_seed(rank))
last = time.perf_counter()
for step, tokens in zip(range(steps), loader, strict=False):
    with observer.step() as observed:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        observed.loss = loss
    now = time.perf_counter()
    print(f"rank {rank} step {step} loss {loss.item():.4f} step_ms {(now - last) * 1e3:.2f}")
    last = now
observer.close()
dist.destroy_process_group()
