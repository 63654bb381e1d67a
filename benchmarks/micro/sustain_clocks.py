"""Per-replay device time of a 16-call CUDA graph over ~1 s of back-to-back replays, with the SM
clock and the power draw NVML reports, for ours and the gmm peer (torch, one GPU):

    python3 benchmarks/micro/sustain_clocks.py qwen3-30b-a3b:4096 [model:T ...]   (writes $OUT/sustain.json)

Results: benchmarks/RESULTS.md, section "Sustained load; the table on fe1d21b"."""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _moe_setup import start  # noqa: E402
import bench_moe as b  # noqa: E402  (benchmarks/, on sys.path through _moe_setup)
from _timing import torch, _capture  # noqa: E402
from ex_engine import moe_fused_gemm  # noqa: E402

cases, reg, gen = start(__doc__, "sustain_clocks")
out = {}
for m, T, s in cases:
    case = f"{m}:{T}"
    w13, w2 = b.layer_weights(s, torch.bfloat16, gen)
    sets = b.input_sets(s, T, 4, w13, w2, torch.bfloat16, gen)
    for name, fn in (("ours", lambda a: moe_fused_gemm(*a, registry=reg)), ("gmm", lambda a: b.gmm_pipeline(*a))):
        fns = [lambda a=a: fn(a) for a in sets]
        for f in fns: f()
        torch.cuda.synchronize()
        g = _capture(fns, 16)
        time.sleep(0.5)  # idle: let the card cool down a moment
        rows = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); e.record(); e.synchronize()
            rows.append((round(time.perf_counter() - t0, 4), a.elapsed_time(e) * 1000 / 16, torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
        out[f"{case} {name}"] = rows
        pick = [rows[i] for i in sorted(set([0, 1, 2, 4, 8, 16, 32, 64, len(rows) // 2, len(rows) - 1])) if i < len(rows)]
        print(case, name, "  ".join(f"t={r[0]:.3f}s {r[1]:.1f}us {r[2]}MHz {r[3]:.0f}W" for r in pick), flush=True)
        del g
    del w13, w2, sets
    torch.cuda.empty_cache()
Path(os.environ.get("OUT", "."), "sustain.json").write_text(json.dumps(out), encoding="utf-8")
