"""Lightning: ``trainer = Trainer(callbacks=[FastdiagCallback(every=10)])``.

The callback attaches to the LightningModule when fitting starts and detaches when it ends. A step
is one training batch (``on_train_batch_start`` .. ``on_train_batch_end``), whatever the module's
``training_step`` calls inside it, so the LightningModule's own ``forward`` need not be used. On a
measured batch the model-level and per-layer values are logged with ``pl_module.log_dict`` as
device tensors (Lightning moves them to the host when it writes to its logger), under
``fastdiag/s_bar``, ``fastdiag/sigma_h``, ``fastdiag/sync/<layer>`` and ``fastdiag/spread/<layer>``.
With ``measure_eval=True`` validation batches are measured too and kept in ``callback.monitor``
(``history(mode="eval")``), not logged. A batch that is a mapping with an ``attention_mask``
(``[batch, seq]``, 1 = real token) has it handed to `Monitor.set_padding` for its step, so padded
positions are left out of the statistics (docs/attach.md, "Padding").
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from collections.abc import Mapping

from fastdiag.core.monitor import Monitor, attach

__all__ = ["FastdiagCallback"]


class FastdiagCallback(Callback):
    def __init__(self, every: int = 10, **attach_kwargs):
        """every, attach_kwargs: as `fastdiag.attach` (``steps`` is fixed to "manual")."""
        super().__init__()
        if "steps" in attach_kwargs:
            raise TypeError("FastdiagCallback: steps are the training batches; do not pass steps=")
        self.every, self.attach_kwargs = every, attach_kwargs
        self.monitor: Monitor | None = None
        self._records_seen = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        self.monitor = attach(pl_module, every=self.every, steps="manual", **self.attach_kwargs)
        self._records_seen = self.monitor.num_records

    def _begin(self, batch, training: bool) -> None:
        self.monitor.begin_step(training=training)
        if isinstance(batch, Mapping) and batch.get("attention_mask") is not None:
            self.monitor.set_padding(batch["attention_mask"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor is not None:
            self._begin(batch, training=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor is None:
            return
        self.monitor.end_step()
        if self.monitor.num_records > self._records_seen:
            self._records_seen = self.monitor.num_records
            values = self.monitor.latest_summary().tensors()
            pl_module.log_dict({f"fastdiag/{k}": v.float() for k, v in values.items()}, on_step=True,
                               on_epoch=False, batch_size=1)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.monitor is not None and self.monitor.measure_eval:
            self._begin(batch, training=False)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.monitor is not None and self.monitor.measure_eval:
            self.monitor.end_step()
            self._records_seen = self.monitor.num_records

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.detach()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_fit_end(trainer, pl_module)
