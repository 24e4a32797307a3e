"""The Hugging Face attach matrix's models and references, shared by the attach tests: real architectures
from tiny random configs (nothing downloaded), sharpened so that a wrong term shows, their inputs
(padded or not), the float64 statistics of the probabilities each model really used, and the check
that attach changes neither outputs nor gradients. Needs transformers (a test module importing this
is skipped without it)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fastdiag

transformers = pytest.importorskip("transformers")

VOCAB, T, T_DEC = 64, 10, 7
TOL = 1e-5          # relative, on s_l, σ_l and the model-level s̄, σ_H
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=VOCAB, max_position_embeddings=64)
DROPOUT0 = dict(attention_dropout=0.0, hidden_dropout=0.0)
BART_SMALL = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0)


ARCHS = {
    # name: (config, model class, kind)   kind: "causal" (decoder-only), "encoder", "seq2seq", "vision"
    "gpt2": (lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
             "GPT2LMHeadModel", "causal"),
    "llama (GQA)": (lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2), "LlamaForCausalLM", "causal"),
    "mistral (sliding window 4)": (lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=4),
                                   "MistralForCausalLM", "causal"),
    "gemma2 (softcap 5, window 4)": (lambda: transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8,
                                                                        attn_logit_softcapping=5.0, sliding_window=4,
                                                                        query_pre_attn_scalar=8),
                                     "Gemma2ForCausalLM", "causal"),
    "falcon": (lambda: transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                 vocab_size=VOCAB, alibi=False, **DROPOUT0),
               "FalconForCausalLM", "causal"),
    "falcon (alibi)": (lambda: transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                         vocab_size=VOCAB, alibi=True, **DROPOUT0),
                       "FalconForCausalLM", "causal"),
    "bloom (alibi)": (lambda: transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=VOCAB,
                                                       **DROPOUT0),
                      "BloomForCausalLM", "causal"),
    "qwen2": (lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2), "Qwen2ForCausalLM", "causal"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**SMALL, attention_dropout=0.0, hidden_dropout=0.0),
                 "GPTNeoXForCausalLM", "causal"),
    "opt": (lambda: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                           vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                                           dropout=0.0, attention_dropout=0.0),
            "OPTForCausalLM", "causal"),
    "bert": (lambda: transformers.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             "BertModel", "encoder"),
    "roberta": (lambda: transformers.RobertaConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                "RobertaModel", "encoder"),
    "distilbert": (lambda: transformers.DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                                         vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0),
                   "DistilBertModel", "encoder"),
    "t5 (relative position bias)": (lambda: transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                                  num_heads=4, vocab_size=VOCAB, dropout_rate=0.0,
                                                                  relative_attention_num_buckets=8),
                                    "T5Model", "seq2seq"),
    "bart": (lambda: transformers.BartConfig(**BART_SMALL), "BartModel", "seq2seq"),
    "gemma3 (window 4)": (lambda: transformers.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=8,
                                                                 sliding_window=4, query_pre_attn_scalar=8),
                          "Gemma3ForCausalLM", "causal"),
    "gpt_oss (attention sinks, window 4)": (lambda: transformers.GptOssConfig(**SMALL, num_key_value_heads=2, head_dim=8,
                                                                              num_local_experts=2, num_experts_per_tok=1,
                                                                              sliding_window=4),
                                            "GptOssForCausalLM", "causal"),
    "modernbert (local window 4)": (lambda: transformers.ModernBertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, attention_dropout=0.0,
        pad_token_id=0), "ModernBertModel", "encoder"),
    "deberta-v2 (disentangled relative attention)": (lambda: transformers.DebertaV2Config(
        **SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=8), "DebertaV2Model", "encoder"),
    "llama4 (chunked attention 4, NoPE layer)": (lambda: transformers.Llama4TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=64, num_local_experts=2,
        attention_chunk_size=4, no_rope_layers=[1, 0]), "Llama4ForCausalLM", "causal"),
    "cohere": (lambda: transformers.CohereConfig(**SMALL, num_key_value_heads=2), "CohereForCausalLM", "causal"),
    "gptj": (lambda: transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                             rotary_dim=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
             "GPTJForCausalLM", "causal"),
    "gpt_bigcode (multi-query)": (lambda: transformers.GPTBigCodeConfig(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, multi_query=True, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0), "GPTBigCodeForCausalLM", "causal"),
    "mpt (alibi)": (lambda: transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=VOCAB, max_seq_len=64,
                                                   attn_config={"alibi": True, "attn_pdrop": 0}),
                    "MptForCausalLM", "causal"),
    "mbart": (lambda: transformers.MBartConfig(**BART_SMALL), "MBartModel", "seq2seq"),
    "markuplm (finite mask -1e4)": (lambda: transformers.MarkupLMConfig(
        **SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "MarkupLMModel", "encoder"),
    "vit": (lambda: transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0),
            "ViTModel", "vision"),
}


INIT_STD = {"t5 (relative position bias)": 0.25}  # T5 does not scale its scores by 1/√d
# Attention sinks: the softmax runs over the keys and one sink logit per head, and the model drops the
# sink column before V (and from output_attentions); fastdiag measures the whole softmax.
SINKS = {"gpt_oss (attention sinks, window 4)"}


def sharpen(model, std: float = 0.5, seed: int | None = None):
    """``model`` in training mode with sharp attention: its weight matrices drawn at ``std`` (at the
    default init attention is near-uniform and σ_H ≈ 1e-5, which would hide a wrong term behind
    float32 rounding); ``seed``: torch's seed first."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.train()


def build(arch: str, impl: str, seed: int = 0):
    """The model, `sharpen`ed: std 0.5, less where the scores would grow so large that float32
    rounding of the scores alone moves σ_l by 1e-5."""
    make_config, cls_name, _ = ARCHS[arch]
    config = make_config()
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)._from_config(config, attn_implementation=impl)
    return sharpen(model, INIT_STD.get(arch, 0.5))


def inputs(arch: str, padded: bool) -> dict:
    kind = ARCHS[arch][2]
    g = torch.Generator().manual_seed(3)
    if kind == "vision":
        return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))
    ids = torch.randint(2, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if padded:
        mask[0, T - 2:] = 0   # right padding: padded rows still see the real keys
        mask[1, :3] = 0       # left padding: in a causal model these rows see no real key
    batch = dict(input_ids=ids, attention_mask=mask)
    if kind == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(2, VOCAB, (2, T_DEC), generator=g)
    return batch


def model_output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def attach_changes(model, run) -> tuple[fastdiag.Monitor, list[str], list[str]]:
    """``run(model)`` and a backward pass, without and then with attach (every=1): (the monitor,
    fastdiag's warnings, what attach changed: "output changed", "gradients changed")."""
    want = run(model)
    want.float().square().mean().backward()
    want_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            got = run(model)
            got.float().square().mean().backward()
    changes = [] if torch.equal(got, want) else ["output changed"]
    if not all((g is None and p.grad is None) or torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), want_grads)):
        changes.append("gradients changed")
    return monitor, [str(w.message) for w in caught if "fastdiag" in str(w.message)], changes


def attached_unchanged(model, run) -> tuple[fastdiag.Monitor, list[str]]:
    """`attach_changes` where attach must change neither outputs nor gradients: (monitor, warnings)."""
    monitor, warned, changes = attach_changes(model, run)
    assert not changes, changes
    return monitor, warned


class CaptureSDPA(TorchFunctionMode):
    """Records the inputs of every scaled_dot_product_attention call (the test's own eyes)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            self.calls.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                               for k, v in dict(zip(names, args), **kwargs).items()})
        return func(*args, **kwargs)


def sdpa_probs(call: dict) -> torch.Tensor:
    """The probabilities of one SDPA call in float64, written out from its Q, K, mask and scale."""
    q, k = call["query"].double(), call["key"].double()
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = call.get("scale") or q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    tq, tk = scores.shape[-2:]
    hidden = torch.zeros(tq, tk, dtype=torch.bool)
    if call.get("is_causal"):
        hidden = torch.ones(tq, tk, dtype=torch.bool).triu(1)
    mask = call.get("attn_mask")
    if mask is not None:
        if mask.dtype == torch.bool:
            hidden = hidden | ~mask
        else:
            hidden = hidden | (mask <= torch.finfo(mask.dtype).min / 2)
            scores = scores + mask.double()
    return torch.nan_to_num(scores.masked_fill(hidden, float("-inf")).softmax(-1), nan=0.0)


def reference(arch: str, model, batch: dict) -> list:
    """Float64 HeadStats, in call order, of the probabilities the model really used: for eager, the
    model's own ``output_attentions``; for sdpa, written out from the inputs of its SDPA calls.
    Padding rows out: the batch's padding positions in self-attention, and rows that see no key."""
    with torch.no_grad():
        if model.config._attn_implementation == "eager":
            out = model(**batch, output_attentions=True)
            if ARCHS[arch][2] != "seq2seq":
                probs = list(out.attentions)
            else:
                probs = list(out.encoder_attentions)
                for self_attn, cross in zip(out.decoder_attentions, out.cross_attentions):
                    probs += [self_attn, cross]
        else:
            with CaptureSDPA() as capture:
                model(**batch)
            probs = [sdpa_probs(call) for call in capture.calls]
    padded = [True] * len(probs)
    if ARCHS[arch][2] == "seq2seq":  # encoder layers first, then (self, cross) per decoder layer: not padded
        encoder_layers = getattr(model.config, "encoder_layers", None) or model.config.num_layers
        padded = [i < encoder_layers for i in range(len(probs))]
    layers = list(zip(probs, padded))
    mask = batch.get("attention_mask")
    result = []
    for probs, padded in layers:
        probs = probs.double()
        if arch in SINKS:          # put back the sink column output_attentions dropped; its rows see a real key
            rows = probs.sum(-1).gt(0).all(1)
            probs = torch.cat([probs, 1 - probs.sum(-1, keepdim=True)], dim=-1)
        else:
            rows = probs.sum(-1).sub(1).abs().lt(1e-6).all(1)   # rows that see some key, every head
        if padded and mask is not None:
            rows = rows & mask.bool()
        result.append(fastdiag.head_stats(probs, rows, backend="reference"))
    return result
