"""fastdiag.attach with Hugging Face transformers: nothing patched, and the Trainer callback (tiny
configs built here, nothing downloaded). The architectures matrix is tests/test_attach_matrix.py."""
import pytest
import torch

import fastdiag

transformers = pytest.importorskip("transformers")



def _gpt2(impl, seed=0):
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation=impl).train()


def test_nothing_in_transformers_or_torch_is_replaced():
    """Attention is seen through a TorchFunctionMode during measured passes, not by patching."""
    from transformers.models.gpt2 import modeling_gpt2

    before = (modeling_gpt2.eager_attention_forward, torch.nn.functional.scaled_dot_product_attention,
              torch.nn.functional.softmax)
    model = _gpt2("eager")
    with fastdiag.attach(model):
        assert (modeling_gpt2.eager_attention_forward, torch.nn.functional.scaled_dot_product_attention,
                torch.nn.functional.softmax) == before
        assert torch.overrides._get_current_function_mode_stack() == []  # entered only inside a pass


def test_hf_trainer_callback(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer needs it
    from fastdiag.integrations.hf import FastdiagCallback

    class Recorder(transformers.TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    g = torch.Generator().manual_seed(0)
    real = torch.ones(8, dtype=torch.long)
    real[6:] = 0  # every example right-padded by 2: the callback hands attention_mask in
    data = [{"input_ids": ids, "attention_mask": real, "labels": ids}
            for ids in torch.randint(0, 50, (16, 8), generator=g)]
    model = _gpt2("sdpa")
    callback, recorder = FastdiagCallback(every=2), Recorder()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[callback, recorder])
    trainer.train()
    history = callback.monitor.history()
    assert all(s.rows.item() == 4 * 6 for s in callback.monitor.latest_stats().values())
    assert [r["step"] for r in history] == [2, 4]            # numbered as the Trainer's steps
    logged = [log for log in recorder.logs if "fastdiag/s_bar" in log]
    assert logged and "fastdiag/sync/transformer.h.1.attn" in logged[-1]
    # each log line (steps 2 and 4) carries the values measured at its own step
    assert [log["fastdiag/s_bar"] for log in logged] == pytest.approx([r["s_bar"] for r in history])
    assert any("fastdiag/s_bar" in entry for entry in trainer.state.log_history)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # detached
