"""attach on Hugging Face families beyond the matrix, each from a tiny random config (nothing
downloaded): every attention module is either measured exactly (float64 statistics of the
probabilities the model returns with ``output_attentions``) or named as not measured — never a
silent number. Outputs unchanged in every case.

A representative sample of what the matrix does not hold: cross-attention with Tq = Tk, block-sparse,
n-gram streams, windowed layouts (XLNet's self-seeing padding: tests/test_attach_precision_and_layouts.py)."""
import warnings

import pytest
import torch

import fastdiag

from tests.helpers import assert_stats_close

transformers = pytest.importorskip("transformers")

from tests.hf_matrix import attached_unchanged, build, inputs, sharpen  # noqa: E402

BATCH = inputs("bert", padded=True)          # 2 x 10 tokens, right padding 2 and left padding 3
REAL = BATCH["attention_mask"].bool()
T = transformers


def _hs(probs, rows=None):
    return fastdiag.head_stats(probs.double(), rows, backend="reference")


def test_perceiver_cross_attention_of_equal_lengths_keeps_every_latent_row():
    """10 latents over 10 inputs, the inputs padded: the cross-attention's rows are the latents, all
    real (provenance, not Tq = Tk); the latents' self-attention has no padding."""
    config = T.PerceiverConfig(num_latents=10, d_latents=32, d_model=16, num_blocks=1, num_self_attends_per_block=1,
                               num_self_attention_heads=4, num_cross_attention_heads=4,
                               attention_probs_dropout_prob=0.0)
    model = sharpen(T.PerceiverModel(config), seed=0)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    monitor, problems = attached_unchanged(model, lambda m: m(inputs=x, attention_mask=BATCH["attention_mask"]).last_hidden_state)
    assert not problems
    with torch.no_grad():
        out = model(inputs=x, attention_mask=BATCH["attention_mask"], output_attentions=True)
    stats = monitor.latest_stats()
    assert list(stats) == ["encoder.cross_attention.attention.self", "encoder.self_attends.0.attention.self"]
    for got, probs in zip(stats.values(), [out.cross_attentions[0], out.attentions[0]]):
        assert got.rows.item() == 20
        assert_stats_close(got, _hs(probs))


def test_bigbird_block_sparse_is_named_not_recorded():
    config = T.BigBirdConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             vocab_size=64, attention_type="block_sparse", block_size=2, num_random_blocks=1,
                             max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = sharpen(T.BigBirdModel(config), seed=0)
    ids = torch.randint(2, 60, (2, 32), generator=torch.Generator().manual_seed(0))
    monitor, problems = attached_unchanged(model, lambda m: m(input_ids=ids).last_hidden_state)
    assert len(problems) == 1 and "'encoder.layer.0.attention.self'" in problems[0] and "attention ops" in problems[0]
    assert monitor.latest() is None and list(monitor.coverage()["missing"]) == ["encoder.layer.0.attention.self"]


def test_prophetnet_ngram_streams_are_named_and_its_other_attention_is_measured():
    config = T.ProphetNetConfig(hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
                                num_decoder_layers=1, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
                                vocab_size=64, ngram=2, num_buckets=8, relative_max_distance=16, dropout=0.0,
                                attention_dropout=0.0, activation_dropout=0.0)
    model = sharpen(T.ProphetNetModel(config), seed=0)
    decoder_ids = BATCH["input_ids"][:, :7]
    monitor, problems = attached_unchanged(model, lambda m: m(**BATCH, decoder_input_ids=decoder_ids).last_hidden_state)
    assert len(problems) == 1 and "'decoder.layers.0.self_attn'" in problems[0] and "5-D scores" in problems[0]
    stats = monitor.latest_stats()
    assert list(stats) == ["encoder.layers.0.self_attn", "decoder.layers.0.cross_attn"]
    # (its output_attentions are not the probabilities it multiplies V by, so no float64 twin here:
    # the encoder's padded rows must be left out, the decoder's 3 streams x 7 rows per sequence kept)
    assert stats["encoder.layers.0.self_attn"].rows.item() == REAL.sum().item() == 15
    assert stats["decoder.layers.0.cross_attn"].rows.item() == 2 * 3 * 7


def _led():
    config = T.LEDConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                         attention_window=4, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                         dropout=0.0, attention_dropout=0.0)
    return T.LEDModel(config), lambda m: m(**BATCH, decoder_input_ids=BATCH["input_ids"][:, :7]).last_hidden_state


def _longformer():
    config = T.LongformerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                vocab_size=64, attention_window=4, max_position_embeddings=64,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return T.LongformerModel(config), lambda m: m(**BATCH).last_hidden_state


@pytest.mark.parametrize("family", ["led", "longformer"])
def test_windowed_layouts_are_named_not_read_as_heads(family):
    """Longformer's [B, T, H, window] scores (LED's encoder the same) are no [B, H, Tq, Tk] map: no
    layer record, the module named; nothing about them is averaged into s̄."""
    model, run = {"led": _led, "longformer": _longformer}[family]()
    monitor, problems = attached_unchanged(sharpen(model, seed=0), run)
    windowed = [n for n in monitor.coverage()["missing"] if "self_attn.longformer_self_attn" in n or
                n.endswith("attention.self")]
    assert windowed and all(any(f"'{n}'" in p for p in problems) for n in windowed)
    assert not any(n in (monitor.latest_stats() or {}) for n in windowed)


def test_generate_with_a_kv_cache_on_a_gqa_model_under_sdpa_records_every_query_head():
    """model.generate() (greedy, left-padded prompt, KV cache): tokens unchanged; every pass — the
    prefill and each one-token decode step, which transformers packs as [B, Hkv, H/Hkv, D] — records
    the model's 4 query heads, not its 2 key/value heads."""
    model = build("llama (GQA)", "sdpa").eval()
    ids = BATCH["input_ids"][:, :6]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                                            # left padding, as generate() expects
    settings = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastdiag.attach(model, every=1, measure_eval=True) as monitor:
                got = model.generate(ids, **settings)
    assert torch.equal(got, want)
    assert not [w for w in caught if "fastdiag" in str(w.message)]
    records = monitor.history(mode="eval")
    assert len(records) == 3                                   # prefill + 2 decode steps
    assert all(stats.num_heads == 4 for stats in monitor.latest_stats().values())
