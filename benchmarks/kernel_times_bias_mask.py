"""Where the time of a masked forward goes: kernel times (torch profiler) of flash_attention with a
(B, H, S, S) bool mask, the same as int8, a head-broadcast mask, and a bias, Gluon forward on and off."""
import torch
from torch.profiler import profile, ProfilerActivity
import dualattn.torch_api as dt
from dualattn import switches
from dualattn.kernels.flash import plan

B, S, H, D = 2, 4096, 16, 128
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
mask = torch.rand(B, H, S, S, device="cuda") < 0.9
cases = {"mask bool": dict(attention_mask=mask), "mask int8": dict(attention_mask=mask.to(torch.int8)),
         "mask (B,1)": dict(attention_mask=mask[:, :1].contiguous()),
         "bias": dict(bias=torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16)), "none": {}}
for flag in (None, "0"):
    switches.set_switches(DUALATTN_GLUON_FWD=flag)
    plan.forget_plans()
    for name, kw in cases.items():
        with torch.no_grad():
            for _ in range(3):
                dt.flash_attention(q, k, v, **kw)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    dt.flash_attention(q, k, v, **kw)
                torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 5 / 1000) for e in prof.key_averages() if e.device_time_total > 0]
        print(f"gluon={flag or 'on'} {name}: " + ", ".join(f"{n[:40]} {t:.3f} ms" for n, t in rows), flush=True)
