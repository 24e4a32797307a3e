"""fastdiag.integrations.lightning.FastdiagCallback with a real Lightning Trainer (CPU, few steps)."""
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from fastdiag.integrations.lightning import FastdiagCallback  # noqa: E402
from fastdiag.testing import NanoGPT  # noqa: E402


class TinyLM(pl.LightningModule):
    """Calls its inner model directly: the LightningModule's own forward is never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.net(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.net(ids)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader():
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def test_lightning_callback_logs_measured_steps(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module, callback = TinyLM(), FastdiagCallback(every=2, measure_eval=True)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=CSVLogger(str(tmp_path)), callbacks=[callback],
                         log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=4)
    trainer.fit(module, _loader(), _loader())
    monitor = callback.monitor
    assert [r["step"] for r in monitor.history(mode="train")] == [0, 2]
    assert len(monitor.history(mode="eval")) == 1
    assert {"fastdiag/s_bar", "fastdiag/sigma_h", "fastdiag/sync/net.blocks.1"} <= set(trainer.logged_metrics)
    assert trainer.logged_metrics["fastdiag/s_bar"].item() == pytest.approx(
        monitor.latest(mode="train")["s_bar"], rel=1e-6)
    csv = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "fastdiag/s_bar" in csv.splitlines()[0]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())  # detached


class PaddedLM(pl.LightningModule):
    """Dict batches with an attention_mask its model never sees (nanoGPT takes no mask)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)

    def training_step(self, batch, batch_idx):
        return self.net(batch["input_ids"]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_callback_hands_the_batch_attention_mask_in():
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 8, dtype=torch.long)
    mask[:, 5:] = 0
    data = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)]
    callback = FastdiagCallback(every=1)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(PaddedLM(), torch.utils.data.DataLoader(data, batch_size=4))
    stats = callback.monitor.latest_stats()
    assert list(stats) == ["net.blocks.0", "net.blocks.1"]
    assert all(s.rows.item() == 4 * 5 for s in stats.values())  # 3 padded rows per sequence left out
