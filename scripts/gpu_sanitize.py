#!/usr/bin/env python3
"""The factors' GPU tests under NVIDIA's compute-sanitizer: every device access checked.

For each tool (default: memcheck racecheck synccheck initcheck):
1. a planted fault first: a small CuPy kernel with the one defect that tool exists to find (a
   write one element past a 1000-float array, inside the allocation's rounding to 256 bytes; two
   warps writing one shared word; a __syncwarp whose mask leaves out the calling threads; a read
   of memory never written). The tool must report it (its error exit status and its words),
   or its silence on the tests below proves nothing and the tool fails;
2. then the GPU tests of the factors (pytest, -m gpu; each tool's selection below) run under it,
   with CuPy's memory pool off (EX_TEST_NO_MEMORY_POOL=1, tests/conftest.py): each array is its
   own cudaMalloc, so a write past one is reported, not absorbed by a pooled neighbour.
   PyTorch's caching allocator is off too (PYTORCH_NO_CUDA_MEMORY_CACHING=1).

A tool passes when its planted fault was reported, every selected test passed (at least one ran)
and the sanitizer reported no error on them. Its whole output is in OUT/sanitize_<tool>.txt;
a table at the end gives each tool's result and time. The selection per tool (memcheck the
widest; the others, many times slower, the forced-configuration tests and the small factors):
see TESTS below, or --list.

What the tools see and what they do not (compute-sanitizer's documentation): memcheck checks
each thread's global and shared loads and stores against the allocations, and the CUDA API
calls; TMA's bulk copies are done by the copy engine of each multiprocessor, outside the
threads' instructions, so a tensor map that reached past an allocation would not show here.
racecheck sees shared-memory hazards between threads; synccheck barrier misuse; initcheck global
reads of memory never written since its allocation.

    python3 scripts/gpu_sanitize.py [--tools memcheck,racecheck] [--timeout memcheck=240,...] [--out DIR]
                                    [--sanitizer PATH] [-k EXPR] [--list]

Exit status: 0 every tool passed; 1 a tool failed (a planted fault not seen, a sanitizer error,
a failing test, no test run, a timeout); 2 bad arguments, no compute-sanitizer, or no CuPy / GPU.
"""
import argparse
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_scripts = runpy.run_path(str(ROOT / "ex_engine" / "_scripts.py"))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# the small set: every forced configuration on five of test_gpu_configs' kinds (ids with "_" for
# "=" and " "), and the router and norm factors' plugin tests
SMALL_KINDS = "T_3_E_40 or E_40_fp16 or one_expert or H_200 or ungated_I_200"
SMALL = ["tests/test_gpu_configs.py", "tests/test_gpu.py", "-k",
         f"(test_moe_every_config and ({SMALL_KINDS})) or test_topk_softmax_plugin or test_fused_add_rmsnorm_plugin"]
# each tool's pytest arguments (after -m gpu): memcheck, the quickest, runs every forced
# configuration on all ten kinds, the registry's own choices on the awkward shapes and the model
# shapes at T = 1 and 64 (bfloat16), and the tests of invalid ids, unaligned sizes, one hot
# expert, no valid slot and empty batches; the others, many times slower, the small set
TESTS = {
    "memcheck": ["tests/test_gpu_configs.py", "tests/test_gpu.py", "-k",
                 "test_moe_every_config or test_topk_softmax_plugin or test_fused_add_rmsnorm_plugin "
                 "or test_moe_plugin_awkward or test_moe_unaligned or test_moe_skewed_and_single "
                 "or test_moe_out_of_range_ids_are or test_moe_empty_batch or test_moe_decode_with_no_valid_slot "
                 "or (test_moe_plugin_on_model_shapes and bfloat16)"],
    "racecheck": SMALL,
    "synccheck": SMALL,
    "initcheck": SMALL,
}
# the planted defect of each tool, and words its report must contain
PLANTED = {
    "memcheck": ("a write one float past a 1000-float array", r"Invalid __global__ write"),
    "racecheck": ("two warps writing one shared word, no barrier", r"[Hh]azard"),
    "synccheck": ("__syncwarp with a mask that leaves out the calling threads", r"[Bb]arrier error|Invalid arguments"),
    "initcheck": ("a read of global memory never written", r"Uninitialized __global__ memory read"),
}
KERNELS = r"""
extern "C" __global__ void oob(float* a, int n) {          // memcheck: a[n] is one past the end
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) a[i] = 1.0f;
}
extern "C" __global__ void race(float* out) {              // racecheck: warps 0 and 1 write s[lane]
    __shared__ float s[32];
    s[threadIdx.x % 32] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}
extern "C" __global__ void badsync(float* out) {           // synccheck: lanes 16-31 not in the mask
    out[threadIdx.x] = 1.0f;
    __syncwarp(0x0000ffffu);
    out[threadIdx.x] += 1.0f;
}
extern "C" __global__ void uninit(const float* a, float* b, int n) {   // initcheck: a never written
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i] + 1.0f;
}
"""
ERROR_STATUS = 86   # the sanitizer's exit status where it reported an error (--error-exitcode)


def plant(tool):
    """Run the planted defect of ``tool`` (this process is the one under the sanitizer)."""
    import cupy as cp
    cp.cuda.set_allocator(None)        # each array its own cudaMalloc, as the tests below
    mod = cp.RawModule(code=KERNELS)
    n = 1000
    if tool == "memcheck":
        a = cp.zeros(n, cp.float32)
        mod.get_function("oob")((4,), (256,), (a, cp.int32(n)))
    elif tool == "racecheck":
        out = cp.zeros(64, cp.float32)
        mod.get_function("race")((1,), (64,), (out,))
    elif tool == "synccheck":
        out = cp.zeros(32, cp.float32)
        mod.get_function("badsync")((1,), (32,), (out,))
    else:
        a, b = cp.empty(n, cp.float32), cp.zeros(n, cp.float32)
        mod.get_function("uninit")((4,), (256,), (a, b, cp.int32(n)))
    cp.cuda.Device().synchronize()
    print(f"planted {tool} defect ran")
    return 0


def parse_timeouts(text):
    """{tool: seconds} of --timeout: "150" (every tool) or "memcheck=240,racecheck=90" (the tools
    not named 150); None where it is neither, or a value is below 1."""
    out = dict.fromkeys(TOOLS, 150)
    try:
        if "=" not in text:
            out = dict.fromkeys(TOOLS, int(text))
        else:
            for part in text.split(","):
                tool, _, secs = part.partition("=")
                if tool.strip() not in TOOLS:
                    return None
                out[tool.strip()] = int(secs)
    except ValueError:
        return None
    return out if min(out.values()) >= 1 else None


def find_sanitizer(given):
    """The compute-sanitizer executable: ``given``, else on PATH, else in a CUDA toolkit's bin/."""
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(Path("/usr/local").glob("cuda-*"))]:
        p = Path(str(base)) / "bin" / "compute-sanitizer"
        if str(base) and p.is_file():
            return str(p)
    return None


def run(cmd, log, timeout, env=None):
    """(exit status or None on timeout, seconds) of cmd, its output appended to log (the whole
    process group stopped at the timeout)."""
    t0 = time.time()
    with open(log, "a", encoding="utf-8", errors="replace") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
            f.write(f"\n[gpu_sanitize: stopped after {timeout} s]\n")
    return rc, time.time() - t0


def judge(rc, text, timeout):
    """(tests, sanitizer summary, verdict) of one tool's pytest run under the sanitizer: rc its exit
    status (None: stopped at ``timeout`` s), text its output. verdict is "clean" only where pytest
    passed (at least one test), the sanitizer's summary says 0 errors and its status is not
    ERROR_STATUS, and the run says CuPy's pool was off. A run stopped at the timeout counts the
    tests of pytest's progress lines ('..F.s [ 12%]') so far."""
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", text)}
    if rc is None:   # no summary line: what the progress lines show
        marks = "".join(m for m in re.findall(r"^([.FEsx]+)\s*\[\s*\d+%\]\s*$", text, re.M))
        counts = {"passed": marks.count("."), "failed": marks.count("F") + marks.count("E"),
                  "skipped": marks.count("s")}
    lines = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: [^\n]*", text)
    # memcheck, synccheck, initcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY:
    # 0 hazards displayed (0 errors, 0 warnings)" (its warnings, hazards it deems possibly benign, kept in the line)
    errors = re.search(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)
    n_err = int(errors.group(1) or errors.group(2)) if errors else None
    tests = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped"
             + (f", {counts['error']} errors" if counts.get("error") else "") + (" so far" if rc is None else ""))
    if rc is None:
        verdict = f"stopped after {timeout} s"
    elif rc == ERROR_STATUS or (n_err or 0) > 0:
        verdict = "sanitizer errors"
    elif rc != 0:
        verdict = f"tests failed (status {rc})"
    elif not counts.get("passed"):
        verdict = "no test ran"
    elif "CuPy memory pool off" not in text:
        verdict = "CuPy's pool was not off"
    elif n_err is None:
        verdict = "no sanitizer summary"
    else:
        verdict = "clean"
    return tests, (lines[-1] if lines else "no summary line"), verdict


def check_tool(tool, san, a):
    """One row of the table: (tool, planted, tests, sanitizer, seconds, ok)."""
    log = Path(a.out) / f"sanitize_{tool}.txt"
    log.write_text("")
    base = [san, "--tool", tool, "--error-exitcode", str(ERROR_STATUS), "--print-limit", "50"]
    rc, t_plant = run(base + [sys.executable, __file__, "--plant", tool], log, 120)
    text = log.read_text(encoding="utf-8", errors="replace")
    what, words = PLANTED[tool]
    seen = rc == ERROR_STATUS and re.search(words, text) is not None
    planted = "seen" if seen else f"NOT SEEN (status {rc})"
    print(f"  {tool}: planted {what}: {planted} ({t_plant:.0f} s)", flush=True)
    env = dict(os.environ, EX_TEST_NO_MEMORY_POOL="1", PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    args = list(TESTS[tool]) if not a.k else SMALL[:-1] + [f"({SMALL[-1]}) and ({a.k})"]
    start = log.stat().st_size
    rc, secs = run(base + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfE",
                           *args], log, a.timeouts[tool], env)
    text = log.read_text(encoding="utf-8", errors="replace")[start:]
    tests, summary, verdict = judge(rc, text, a.timeouts[tool])
    ok = seen and verdict == "clean"
    print(f"  {tool}: {tests}; {summary}; {verdict} ({secs:.0f} s)", flush=True)
    if not seen:
        verdict = f"planted fault not seen; tests {verdict}"
    return tool, planted, tests, summary, secs + t_plant, ok, verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated compute-sanitizer tools to run")
    ap.add_argument("--timeout", default="memcheck=240,racecheck=150,synccheck=90,initcheck=120",
                    help="seconds for each tool's tests: one number for all, or tool=seconds pairs "
                         "(a tool not named: 150)")
    ap.add_argument("--out", default=str(ROOT / "gpu_out"), help="folder of the logs (sanitize_<tool>.txt)")
    ap.add_argument("--sanitizer", default=None, help="compute-sanitizer executable (default: PATH, then CUDA's bin/)")
    ap.add_argument("-k", default=None, help="run the small set (forced configurations, topk_softmax, "
                                              "fused_add_rmsnorm) narrowed by this pytest -k expression instead")
    ap.add_argument("--list", action="store_true", help="print each tool's pytest arguments and stop")
    ap.add_argument("--plant", choices=TOOLS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plant:
        return plant(a.plant)
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        print(f"gpu_sanitize: --tools: expected some of {','.join(TOOLS)}, comma-separated, got {a.tools!r}",
              file=sys.stderr)
        return 2
    timeouts = parse_timeouts(a.timeout)
    if timeouts is None:
        print(f"gpu_sanitize: --timeout: expected seconds >= 1, or tool=seconds pairs of {','.join(TOOLS)} "
              f"(e.g. memcheck=240,racecheck=90), got {a.timeout!r}", file=sys.stderr)
        return 2
    a.timeouts = timeouts
    if a.list:
        for t in tools:
            args = TESTS[t] if not a.k else SMALL[:-1] + [f"({SMALL[-1]}) and ({a.k})"]
            print(f"{t} ({timeouts[t]} s): pytest -m gpu " + " ".join(f"'{x}'" if " " in x else x for x in args))
        return 0
    san = find_sanitizer(a.sanitizer)
    if san is None:
        print(f"gpu_sanitize: --sanitizer: expected a compute-sanitizer executable, got "
              f"{a.sanitizer or 'none on PATH or in /usr/local/cuda*/bin'}", file=sys.stderr)
        return 2
    cupy, why = _scripts["cupy_with_gpu"]()
    if cupy is None:
        print(f"gpu_sanitize: needs CuPy and a CUDA GPU: {why}", file=sys.stderr)
        return 2
    try:
        Path(a.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"gpu_sanitize: --out: cannot make the log folder {a.out}: {exc}", file=sys.stderr)
        return 2
    print(f"compute-sanitizer: {san}; tools: {', '.join(tools)}; logs in {a.out}", flush=True)
    rows = []
    for i, t in enumerate(tools, 1):
        print(f"[{i}/{len(tools)}] {t} ...", flush=True)
        rows.append(check_tool(t, san, a))
    print("\n| tool | planted fault | tests | sanitizer | s | result |\n| --- | --- | --- | --- | ---: | --- |")
    for tool, planted, tests, summary, secs, ok, verdict in rows:
        print(f"| {tool} | {planted} | {tests} | {summary} | {secs:.0f} | {'PASS' if ok else 'FAIL: ' + verdict} |")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    _scripts["exit_quietly_on_broken_pipe"](main)
