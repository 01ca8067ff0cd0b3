"""HF transformers with attn_implementation="dualattn": tiny random models (no downloads), logits and
gradients against the same weights under transformers' own eager attention."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dualattn.integrations import transformers as dualattn_hf  # noqa: E402

VOCAB = 64


def _pair(config_cls, **kw):
    dualattn_hf.register()
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, **kw)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").float()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="dualattn").float()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "dualattn" and eager.config._attn_implementation == "eager"
    return eager, ours


def _logits_and_grads(models, ids, attention_mask, real):
    """Each model's logits and its attention weights' gradients of a loss over the `real` positions."""
    results = []
    for m in models:
        m.zero_grad()
        logits = m(ids, attention_mask=attention_mask).logits
        (logits[real] * torch.linspace(-1, 1, VOCAB)).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                          if p.grad is not None and "self_attn" in n}))
    return results


def _assert_same(eager_result, ours_result, real):
    (logits_e, grads_e), (logits_o, grads_o) = eager_result, ours_result
    torch.testing.assert_close(logits_o[real], logits_e[real], atol=2e-5, rtol=1e-4)
    assert grads_e.keys() == grads_o.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_o[name], grads_e[name], atol=5e-5, rtol=1e-3, msg=name)


def _compare(eager, ours, torch_gen, seq=32, left_pad=5):
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch_gen)
    padding = torch.ones(2, seq, dtype=torch.long)
    padding[1, :left_pad] = 0
    real = padding.bool()
    calls = []
    real_attention = dualattn_hf.attention

    def spy(*args, **kw):
        calls.append(kw["mask_info"])
        return real_attention(*args, **kw)

    dualattn_hf.attention = spy
    try:
        results = _logits_and_grads((eager, ours), ids, padding, real)
    finally:
        dualattn_hf.attention = real_attention
    # Padding reached the kernels as segment ids, never as an Sq x Sk mask.
    assert calls and all(c.attention_mask is None and c.q_segment_ids is not None for c in calls)
    _assert_same(*results, real)


def test_llama_style_gqa_with_padding(torch_gen):
    eager, ours = _pair(transformers.LlamaConfig)
    _compare(eager, ours, torch_gen)


def test_gemma2_style_soft_cap_and_sliding_window(torch_gen):
    eager, ours = _pair(transformers.Gemma2Config, sliding_window=8, attn_logit_softcapping=20.0,
                        final_logit_softcapping=None, query_pre_attn_scalar=16)
    assert any(getattr(layer.self_attn, "sliding_window", None) for layer in ours.model.layers)
    _compare(eager, ours, torch_gen)


def test_gpt_oss_style_sinks(torch_gen):
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no GPT-OSS")
    eager, ours = _pair(transformers.GptOssConfig, num_local_experts=2, num_experts_per_tok=1, sliding_window=8)
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.normal_(generator=torch_gen)
    ours.load_state_dict(eager.state_dict())
    _compare(eager, ours, torch_gen)


def test_output_attentions_is_rejected(torch_gen):
    _, ours = _pair(transformers.LlamaConfig)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(torch.randint(0, VOCAB, (1, 8), generator=torch_gen), output_attentions=True)


@pytest.mark.parametrize("masked", [-1e9, -1e4, "dtype_min"])
def test_caller_4d_additive_mask_is_applied_as_eager_applies_it(masked, torch_gen):
    """A caller's own 4-D additive float mask (a prefix-LM pattern: the first tokens see each other,
    the rest are causal; left padding) with any large negative value for "masked" gives eager's
    logits and gradients: the mask is the whole pattern, added as a bias."""
    eager, ours = _pair(transformers.LlamaConfig)
    seq, prefix, left_pad = 24, 6, 4
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch_gen)
    keys_real = torch.ones(2, seq, dtype=torch.bool)
    keys_real[1, :left_pad] = False
    pos = torch.arange(seq)
    allowed = (pos[None, :] <= pos[:, None]) | ((pos[:, None] < prefix) & (pos[None, :] < prefix))
    allowed = allowed[None, None] & keys_real[:, None, None, :]
    value = torch.finfo(torch.float32).min if masked == "dtype_min" else masked
    mask = torch.zeros(2, 1, seq, seq).masked_fill(~allowed, value)
    real = keys_real & allowed[:, 0].any(-1)          # query rows with a key to attend
    _assert_same(*_logits_and_grads((eager, ours), ids, mask, real), real)
    # The prefix is bidirectional: a causal pattern on top would change its logits.
    causal_only = _logits_and_grads((eager,), ids, mask.masked_fill(pos[None, :] > pos[:, None], value), real)
    assert not torch.allclose(causal_only[0][0][real], _logits_and_grads((ours,), ids, mask, real)[0][0][real],
                              atol=1e-3)
