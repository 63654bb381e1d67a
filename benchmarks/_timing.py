"""Timers shared by the benchmarks (torch, one CUDA device).

graph_us: device µs per call of a CUDA graph that cycles over ``fns`` (one zero-argument
callable per input set, so the sets can be rotated past the L2), after a warm-up of the graph;
host_us: host µs of one eager call, device work left to overlap; ceilings: the card's matmul,
copy and write ceilings with graph_us's timer; run_meta: the date, device and commit a result file records;
ClockSampler: the SM clock and power while a block runs (NVML).
"""
from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time

try:
    import torch
except ImportError:  # the timers need it; the scripts say so before timing
    torch = None


def run_meta(**extra) -> dict:
    """What a result file records of its run (benchmarks/RESULTS.md asks date, device and commit
    of every result): today's date, the CUDA device's name, the commit the tree is at (`git
    describe --always --dirty`; '-dirty' when the tree differs from it; the environment variable
    EX_COMMIT overrides it, for a copy of a working tree on a GPU machine that carries an older
    .git; '?' where neither is there), torch's version, then ``extra``."""
    commit = os.environ.get("EX_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                    encoding="utf-8", cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            commit = ""
    device = torch.cuda.get_device_name() if torch is not None and torch.cuda.is_available() else "?"
    return {"date": datetime.date.today().isoformat(), "device": device, "commit": commit or "?",
            "torch": torch.__version__ if torch is not None else None, **extra}


def _capture(fns, calls: int):
    """A CUDA graph of ``calls`` calls cycling over ``fns``."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    return g


def _warm_up(fns) -> None:
    """Each callable of ``fns`` once on a side stream, before a capture (lazy allocations, a
    first launch's set-up: nothing of that may happen inside a graph), then a device sync."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def graph_outputs(fns) -> list:
    """The tensors ``fns`` (zero-argument callables, each returning one tensor) return when a
    CUDA graph of one call each is captured, filled with NaN (float tensors; -1 otherwise) and
    then written by one replay of that graph: what graph replay computes. An element a callable
    leaves unwritten reads NaN only where its tensor was allocated before the capture (e.g. an
    ``out=`` buffer): a tensor allocated inside the capture comes from the graph's private pool,
    whose memory freed during the capture is reused, so an earlier call's temporary may share it
    and the replay then writes that temporary's values over the poison (seen on the H200: sets
    1 and 2 of three read finite errors, 0.045 on set 1, instead of inf; set 0, whose output
    was allocated before any temporary was freed, read inf). Each callable
    runs once on a side stream first (warm-up, as in graph_us). Tensors allocated in the
    capture live in that pool, which PyTorch keeps while they are referenced."""
    _warm_up(fns)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn() for fn in fns]
    for o in outs:
        o.fill_(float("nan") if o.is_floating_point() else -1)
    g.replay()
    torch.cuda.synchronize()
    return outs


def write_json(path, data) -> None:
    """``data`` as indented JSON to ``path``, atomically (trust.replace_file, not synced: a run
    interrupted while it writes leaves the previous complete file, not a truncated one; the
    scripts rewrite theirs after every row)."""
    import json
    from ex_engine.trust import replace_file
    replace_file(path, json.dumps(data, indent=1), fsync=False)


def graph_us(fns, calls: int | None = None, replays: int = 20, warm_ms: float = 20.0) -> float:
    """Median device µs per call over ``replays`` replays of a graph of ``calls`` calls cycling
    over ``fns`` (one zero-argument callable per input set). By default a graph holds one call
    per callable, and, where one call takes under 1 ms, the multiple of that reaching 16 calls:
    the graph's own launch, paid once per replay, is then spread over many calls as in an
    engine's graph of a whole model. Each callable runs once on a side stream before capture
    (warm-up, lazy allocations); the graph is replayed for at least ``warm_ms`` ms before timing,
    so that a row does not start with the clocks where an idle moment or another row left them."""
    fns = fns if isinstance(fns, list) else [fns]
    n = len(fns)
    _warm_up(fns)
    g = _capture(fns, max(calls or n, n))
    if calls is None:
        g.replay()   # the first replay also uploads the graph: not the one that is timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        if (time.perf_counter() - t0) / n < 1e-3 and n < 16:
            calls = n * -(-16 // n)
            del g
            g = _capture(fns, calls)
        else:
            calls = n
    calls = max(calls, n)
    t0 = time.perf_counter()
    while True:
        g.replay()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= warm_ms / 1e3:
            break
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    times.sort()
    return times[len(times) // 2]


class ClockSampler:
    """SM clock (MHz), board power (W) and the clock-event reasons of GPU ``index``, sampled by
    NVML (pynvml, which torch.cuda's clock_rate uses) every ``period_s`` on a thread while the
    ``with`` block runs; ``summary()`` gives the medians, ranges and the reasons' bit mask OR-ed
    over the samples (0x4: the software power cap), or why nothing was sampled. The power-limited
    H200 sets its clock by what the tensor cores multiply: on near-zero rows it held 1850 MHz
    against ~1500 on real ones at the same ~690 W (RESULTS.md, session thirty-one), so a time
    that moves should be read with the clock it ran at."""

    def __init__(self, index: int = 0, period_s: float = 0.01):
        self.index, self.period_s, self.samples, self.problem = index, period_s, [], None

    def __enter__(self):
        import threading
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        except Exception as exc:   # not installed, no driver, no device
            self.problem = f"no NVML ({type(exc).__name__}: {exc})"
            self._thread = None
            return self
        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                try:
                    self.samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                                         pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, reasons(h)))
                except Exception as exc:
                    self.problem = f"NVML failed ({type(exc).__name__}: {exc})"
                    return
                time.sleep(self.period_s)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return False

    def summary(self) -> str:
        if not self.samples:
            return self.problem or "no NVML samples"
        clk = sorted(x[0] for x in self.samples)
        pw = sorted(x[1] for x in self.samples)
        mask = 0
        for x in self.samples:
            mask |= int(x[2])
        return (f"SM {clk[len(clk) // 2]} MHz ({clk[0]}-{clk[-1]}), {pw[len(pw) // 2]:.0f} W "
                f"({pw[0]:.0f}-{pw[-1]:.0f}), clock-event reasons 0x{mask:x}, {len(self.samples)} samples")


def ceilings(warm_ms: float = 20.0) -> dict:
    """The card's ceilings measured here and now with graph_us's timer, for ratios that share the
    benchmark's clocks: bf16 torch.matmul of 8192 x 8192 x 8192 (random normal data, as ../shared/PERF.md's
    787 TFLOP/s), a device-to-device copy of 2 GiB by an elementwise kernel (bytes read +
    written, as ../shared/PERF.md's 4229 GB/s) and a fill of 2 GiB by an elementwise kernel (bytes
    written only: the rate that bounds a pass that mostly writes, such as moe_fused_gemm's gather;
    3.18 TB/s against a 4.06 TB/s copy on the H200, RESULTS.md, session forty-four). Returns
    {"matmul_tflops": ..., "copy_gbs": ..., "write_gbs": ...}; allocates ~4.4 GB (back to torch's
    cache when it returns)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t_mm = graph_us([lambda: torch.matmul(a, b, out=c)], calls=4, warm_ms=warm_ms)
    nbytes = 2 << 30   # copied by an SM kernel (torch.neg): a memcpy node in a graph may run on a
    src = torch.ones(nbytes // 4, device="cuda", dtype=torch.float32)   # copy engine (2.8 TB/s)
    dst = torch.empty_like(src)
    t_cp = graph_us([lambda: torch.neg(src, out=dst)], calls=4, warm_ms=warm_ms)
    t_wr = graph_us([lambda: dst.fill_(2.0)], calls=4, warm_ms=warm_ms)
    return {"matmul_tflops": 2.0 * n ** 3 / t_mm / 1e6, "copy_gbs": 2.0 * nbytes / t_cp / 1e3,
            "write_gbs": nbytes / t_wr / 1e3}


def host_us(fn, reps: int = 200, trials: int = 7, warm_ms: float = 100.0) -> float:
    """Host µs of one eager call of ``fn()`` (validation, dispatch, launches), after ``warm_ms``
    ms of calls (on the lent hosts every pure-Python step ran up to ~1.6x slower at times, for
    seconds, whatever the model: RESULTS.md, "Sustained load"; a warm-up outlasts only a short such
    phase): the median over ``trials`` runs of
    ``reps // trials`` back-to-back calls each (the lent machine's host timings jump by tens of
    µs for a moment now and then; the median of several short runs is what a call costs most of
    the time, the mean of one long run is not)."""
    t0 = time.perf_counter()
    while True:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= warm_ms / 1e3:
            break
    torch.cuda.synchronize()
    n = max(1, reps // trials)
    per_call = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        per_call.append((t1 - t0) * 1e6 / n)
    return statistics.median(per_call)


def _users() -> list:
    """The scripts beside this module that import it."""
    from pathlib import Path
    here = Path(__file__).resolve().parent
    return sorted(p.name for p in here.glob("*.py")
                  if p.name != "_timing.py" and "from _timing import" in p.read_text(encoding="utf-8"))


def main(argv=None) -> int:
    """`python benchmarks/_timing.py [--help]`: this is a library module; say so, and which
    scripts to run instead (exit status 0 for --help, 2 otherwise: nothing was timed)."""
    import argparse
    import sys
    users = ", ".join(_users())
    ap = argparse.ArgumentParser(
        prog="_timing.py",
        description="A library module, not a benchmark: the timers graph_us (device µs per call "
                    "of a CUDA graph replay, torch) and host_us (host µs of one eager call) that "
                    f"the benchmarks import. Nothing to run on its own: run one of {users} "
                    "(each has --help).")
    ap.parse_args(argv)
    print(f"_timing.py: a library module of timers (graph_us, host_us); nothing to run on its own; "
          f"run one of {users} (each has --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    import runpy
    from pathlib import Path
    # 'µs' in its --help, escaped under an ASCII locale; `> /dev/full`: one line, no traceback (the
    # helper loaded by path, as table_moe.py does)
    _scripts = runpy.run_path(str(Path(__file__).resolve().parents[1] / "ex_engine" / "_scripts.py"))
    _scripts["exit_quietly_on_broken_pipe"](main)
