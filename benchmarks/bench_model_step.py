"""One training step of a small language model, tokens/s, with and without dualattn, torch and jax.

    python benchmarks/bench_model_step.py                 # H100: both frameworks, full sizes
    python benchmarks/bench_model_step.py --quick         # H100: < 3 min
    python benchmarks/bench_model_step.py --device cpu    # CPU dry run (tiny model, interpreter; checks the script)

torch: an HF transformers Llama-style model (GQA) from a config (no downloads), attn_implementation
"sdpa" (torch's own) against "dualattn" (dualattn.integrations.transformers), AdamW step.
jax: a Flax nnx decoder (causal self-attention blocks) with nnx.MultiHeadAttention (jax's XLA
attention) against dualattn.jax_api.nnx.MultiHeadAttention, optax AdamW step under nnx.jit.
Time per step: warm-up steps (compilation) untimed, then back-to-back steps with one
synchronisation at the end, median of rounds.  JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's dualattn
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SIZES = {  # hidden, layers, heads, kv_heads, seq, batch
    "full": dict(hidden=1024, layers=8, heads=16, kv_heads=4, seq=2048, batch=8, vocab=32000),
    "quick": dict(hidden=1024, layers=4, heads=16, kv_heads=4, seq=2048, batch=4, vocab=32000),
    "cpu": dict(hidden=64, layers=1, heads=4, kv_heads=2, seq=32, batch=1, vocab=128),
}


def _median_step(step, sync, warmup: int, rounds: int, per_round: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            step()
        sync()
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def torch_step(size: dict, attn: str, device: str, dtype: str, timing: dict) -> float:
    import copy

    import torch
    import transformers

    import dualattn.integrations.transformers as dualattn_hf
    dualattn_hf.register()
    config = transformers.LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                      intermediate_size=size["hidden"] * 4, num_hidden_layers=size["layers"],
                                      num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                                      max_position_embeddings=size["seq"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn)
    model = model.to(device=device, dtype=getattr(torch, dtype)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)

    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return _median_step(step, sync, **timing)


def jax_step(size: dict, attn: str, dtype: str, timing: dict) -> float:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dualattn.jax_api.nnx import MultiHeadAttention as DualattnMHA

    mha_cls = DualattnMHA if attn == "dualattn" else nnx.MultiHeadAttention
    dt = jnp.dtype(dtype)

    class Block(nnx.Module):
        def __init__(self, rngs):
            h = size["hidden"]
            self.norm1, self.norm2 = nnx.RMSNorm(h, rngs=rngs), nnx.RMSNorm(h, rngs=rngs)
            self.attn = mha_cls(num_heads=size["heads"], in_features=h, num_kv_heads=size["kv_heads"], decode=False,
                                use_bias=False, dtype=dt, rngs=rngs)
            self.up, self.down = nnx.Linear(h, 4 * h, dtype=dt, rngs=rngs), nnx.Linear(4 * h, h, dtype=dt, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x), is_causal=True)
            return x + self.down(jax.nn.silu(self.up(self.norm2(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(size["vocab"], size["hidden"], dtype=dt, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(size["layers"])])
            self.head = nnx.Linear(size["hidden"], size["vocab"], dtype=dt, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    ids = jax.random.randint(jax.random.PRNGKey(0), (size["batch"], size["seq"]), 0, size["vocab"])

    @nnx.jit
    def train(model, opt, ids):
        def loss_fn(model):
            logits = model(ids[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    last = {}

    def step():
        last["loss"] = train(model, opt, ids)

    return _median_step(step, lambda: jax.block_until_ready(last["loss"]), **timing)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer steps (< 3 min on an H100)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: tiny dry run")
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    cpu = args.device == "cpu"
    size = SIZES["cpu" if cpu else "quick" if args.quick else "full"]
    timing = dict(warmup=1, rounds=1, per_round=1) if cpu else dict(warmup=3, rounds=3, per_round=3) if args.quick \
        else dict(warmup=5, rounds=5, per_round=5)
    dtype = "float32" if cpu else "bfloat16"
    tokens = size["batch"] * size["seq"]
    rows = []
    for fw in args.frameworks.split(","):
        for attn in (("sdpa", "dualattn") if fw == "torch" else ("xla", "dualattn")):
            seconds = torch_step(size, attn, args.device, dtype, timing) if fw == "torch" else \
                jax_step(size, attn, dtype, timing)
            rows.append(dict(framework=fw, attention=attn, step_s=seconds, tokens_per_s=tokens / seconds))
            print(f"{fw:5s} {attn:8s} {seconds * 1e3:9.1f} ms/step {tokens / seconds:12.0f} tokens/s", flush=True)
    for fw in {r["framework"] for r in rows}:
        base, ours = (r for r in rows if r["framework"] == fw)
        print(f"{fw}: dualattn / {base['attention']} = {ours['tokens_per_s'] / base['tokens_per_s']:.3f}x tokens/s")
    device_name = "cpu"
    if not cpu:
        import torch
        device_name = torch.cuda.get_device_name(0)
    stamp = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    gpu = device_name.split()[-1].lower().replace(" ", "")   # "NVIDIA H100 80GB HBM3" -> "hbm3"; keep the model name
    gpu = next((w.lower() for w in device_name.split() if w[:1] in "HAB" and w[1:4].isdigit()), gpu)
    tag = "cpu_dryrun" if cpu else f"{gpu}_quick" if args.quick else gpu
    path = os.path.join(args.out, f"{stamp}_{tag}_model_step.json")
    with open(path, "w") as f:
        json.dump(dict(size=size, dtype=dtype, tokens_per_step=tokens, device=device_name, host=platform.node(),
                       timing=timing, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
