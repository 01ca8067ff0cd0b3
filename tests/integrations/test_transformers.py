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
        logits = [m(ids, attention_mask=padding).logits for m in (eager, ours)]
    finally:
        dualattn_hf.attention = real_attention
    # Padding reached the kernels as segment ids, never as an Sq x Sk mask.
    assert calls and all(c.attention_mask is None and c.q_segment_ids is not None for c in calls)
    torch.testing.assert_close(logits[1][real], logits[0][real], atol=2e-5, rtol=1e-4)
    grads = []
    for m, out in zip((eager, ours), logits):
        m.zero_grad()
        (out[real] * torch.linspace(-1, 1, VOCAB)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None and "self_attn" in n})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=5e-5, rtol=1e-3, msg=name)


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
