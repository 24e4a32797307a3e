"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[FastdiagCallback(every=10)])``.

The callback attaches to the model when training begins and detaches when it ends. A step is one
training forward pass of the model (with gradient accumulation, one micro-batch), counted from 1 as
the Trainer counts its steps (``state.global_step`` after that step): steps ``every``, ``2·every``, ...
are measured, so with ``logging_steps`` a multiple of ``every`` each log line carries the values of
the step it is logged at (with gradient accumulation G, the step's last micro-batch is measured when
``every`` is a multiple of G). Whenever the Trainer logs, the latest measured values are added to its
``logs`` (so callbacks and integrations after this one, and ``trainer.state.log_history``, see them)
as ``fastdiag/s_bar``,
``fastdiag/sigma_h``, ``fastdiag/sync/<layer>`` and ``fastdiag/spread/<layer>``. Every record is in
``callback.monitor.history()``; pass ``log=SummaryWriter(...)`` to write each one to TensorBoard.
Each forward's ``attention_mask`` is handed to `Monitor.set_padding`, so padded positions are left
out of the statistics (docs/attach.md, "Padding") even where the attention itself does not mask them;
in an encoder-decoder only to the encoder's attention (``decoder_attention_mask`` to the decoder's).
"""
from __future__ import annotations

import torch
from transformers import TrainerCallback

from fastdiag.core.monitor import Monitor, attach

__all__ = ["FastdiagCallback"]


class FastdiagCallback(TrainerCallback):
    def __init__(self, every: int = 10, **attach_kwargs):
        """every, attach_kwargs: as `fastdiag.attach`."""
        self.every, self.attach_kwargs = every, attach_kwargs
        self.monitor: Monitor | None = None
        self._records_seen = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("FastdiagCallback: the Trainer passed no model to on_train_begin")
        self.monitor = attach(model, every=self.every, **self.attach_kwargs)
        # The next forward is micro-batch `global_step · G + 1`: numbered as the Trainer numbers its steps,
        # so a log at step k reads the step measured at k, not the one `every` steps before it.
        if state is not None:   # called by hand (no Trainer state): count from step 0
            accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
            self.monitor.set_step(state.global_step * max(1, accumulation) + 1)
        self._records_seen = 0
        monitor = self.monitor
        # An encoder-decoder's attention_mask is the encoder's: handed to the encoder's attention only
        # (T5 with equal source and target lengths would otherwise drop real decoder rows), and
        # decoder_attention_mask to the decoder's. Where the two cannot be found, none is handed in.
        scopes = {"attention_mask": ""}
        if getattr(getattr(monitor.model, "config", None), "is_encoder_decoder", False):
            names = {id(m): n for n, m in monitor.model.named_modules()}
            parts = [getattr(monitor.model, f"get_{part}", lambda: None)() for part in ("encoder", "decoder")]
            scopes = {key: names[id(part)] for key, part in zip(("attention_mask", "decoder_attention_mask"), parts)
                      if part is not None and id(part) in names}

        @torch.compiler.disable
        def hand_in_padding(module, args, kwargs):
            monitor.set_padding(None)
            for key, within in scopes.items():
                mask = kwargs.get(key)
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    monitor.set_padding(mask, within=within)

        self._padding_hook = self.monitor.model.register_forward_pre_hook(hand_in_padding, with_kwargs=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or logs is None or self.monitor.num_records == self._records_seen:
            return
        self._records_seen = self.monitor.num_records
        latest = self.monitor.latest(mode="train")
        if latest is None:
            return
        values = {f"fastdiag/{k}": v for k, v in latest.items() if k not in ("step", "mode")}
        logs.update(values)
        if state.log_history:
            state.log_history[-1].update(values)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self._padding_hook.remove()
            self.monitor.detach()
