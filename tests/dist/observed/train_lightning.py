# A user's Lightning script (the DDP strategy on two CPU ranks) with plait's callback added.
import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from plait.integrations.lightning import PlaitCallback

vocab, dim, seq_len, batch_size = 128, 64, 32, 4


class LitLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(vocab, dim),
            torch.nn.Linear(dim, dim),
            torch.nn.GELU(),
            torch.nn.Linear(dim, vocab),
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = torch.randint(0, vocab, (64, seq_len + 1), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_steps=5,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[PlaitCallback()],
)
trainer.fit(LitLM(), loader)
