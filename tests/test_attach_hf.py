"""fastdiag.attach on Hugging Face transformers models (eager and sdpa attention, GQA) and the
Trainer callback. Tiny configs built here, nothing downloaded."""
import pytest
import torch

import fastdiag

transformers = pytest.importorskip("transformers")

from tests.test_attach import assert_stats_close, detach_everything  # noqa: F401,E402


def _gpt2(impl, seed=0):
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation=impl).train()


def _llama(impl, seed=0):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                      max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl).train()


BUILD = {"gpt2": _gpt2, "llama": _llama}
ATTN_NAMES = {"gpt2": ["transformer.h.0.attn", "transformer.h.1.attn"],
              "llama": ["model.layers.0.self_attn", "model.layers.1.self_attn"]}


def _inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    return dict(input_ids=ids, attention_mask=mask)


def _reference(arch, state):
    """Per-layer float64 statistics of the eager model's own attention probabilities."""
    eager = BUILD[arch]("eager")
    eager.load_state_dict(state)
    eager.eval()
    with torch.no_grad():
        attentions = eager(**_inputs(), output_attentions=True).attentions
    return [fastdiag.head_stats(a, backend="reference") for a in attentions]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_attention_matches_eager_output_attentions(arch, impl):
    model = BUILD[arch](impl)
    assert model.config._attn_implementation == impl
    inputs = _inputs()
    want = model(**inputs).logits
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with fastdiag.attach(model, every=1) as monitor:
        logits = model(**inputs).logits
        logits.square().sum().backward()
    assert torch.equal(logits, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))
    assert monitor.found["hf"] == ATTN_NAMES[arch]
    stats = monitor.latest_stats()
    assert list(stats) == ATTN_NAMES[arch]
    for name, ref in zip(ATTN_NAMES[arch], _reference(arch, model.state_dict())):
        assert_stats_close(stats[name], ref)


def test_hf_patches_are_removed_on_detach():
    from transformers.models.gpt2 import modeling_gpt2

    original = modeling_gpt2.eager_attention_forward
    sdpa = torch.nn.functional.scaled_dot_product_attention
    model = _gpt2("eager")
    with fastdiag.attach(model):
        assert modeling_gpt2.eager_attention_forward is not original
    assert modeling_gpt2.eager_attention_forward is original
    assert torch.nn.functional.scaled_dot_product_attention is sdpa


def test_hf_trainer_callback(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer needs it
    from fastdiag.integrations.hf import FastdiagCallback

    class Recorder(transformers.TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (16, 8), generator=g)]
    model = _gpt2("sdpa")
    callback, recorder = FastdiagCallback(every=2), Recorder()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[callback, recorder])
    trainer.train()
    history = callback.monitor.history()
    assert [r["step"] for r in history] == [0, 2]
    logged = [log for log in recorder.logs if "fastdiag/s_bar" in log]
    assert logged and "fastdiag/sync/transformer.h.1.attn" in logged[-1]
    assert logged[-1]["fastdiag/s_bar"] == pytest.approx(history[-1]["s_bar"])
    assert any("fastdiag/s_bar" in entry for entry in trainer.state.log_history)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # detached
