#!/usr/bin/env python3
"""The factors' GPU tests under NVIDIA's compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

For each tool (default: all four, in that order):
1. planted faults first, each in a process of its own, which the tool must report (its error
   exit status and its words), or its silence on the tests below proves nothing and the tool
   fails. memcheck: a CuPy kernel's write one element past a 1000-float array (inside the
   allocation's rounding to 256 bytes), and the moe_fused_gemm plugin (factors/moe_fused_gemm.so,
   called through its C entry point) given an output one row short, so the check reaches the
   kernels of a library opened at run time; racecheck: two warps writing one shared word;
   synccheck: a __syncwarp whose mask leaves out the calling lanes; initcheck: a read of memory
   never written;
2. then the GPU tests of the factors (pytest -m gpu; each tool's selection in TESTS, or --list:
   every tile configuration of moe_fused_gemm forced on five awkward shapes on both plugins, and
   the router and norm factors' plugin tests, 136 tests; racecheck, the slowest, 38) under the
   tool, with CuPy's memory pool off and every registry's workspace released after each test
   (EX_TEST_NO_MEMORY_POOL=1, tests/conftest.py): each array, and each test's first workspace,
   is a cudaMalloc of its own size, so a write past one is an access outside any allocation, not
   into a pooled neighbour's bytes; memcheck pads each allocation (--padding) so an access that
   runs on into the next allocation is caught too. PyTorch's caching allocator is off as well
   (PYTORCH_NO_CUDA_MEMORY_CACHING=1).

A tool passes when its planted faults were reported, every selected test passed (none skipped:
a plugin not built or not ready would skip its cases) and the sanitizer reported no error (nor,
for racecheck, a warning). Its whole output is in OUT/sanitize_<tool>.txt, the device memory
free after each test in OUT/sanitize_<tool>_memory.txt (the least is said with the tool's
result: "out of memory" from a leak or from one test too large for the tool); a table at the end
gives each tool's result and time. A tool may take up to 9 minutes (--timeout, 540 s each): on a
machine lent for 10 minutes a call, run one tool a call (--tools memcheck).

What is not checked: CuPy's own kernels and the CUB and thrust kernels it runs (EXCLUDE: those
the tests' inputs and references run; not where this compute-sanitizer lacks
--kernel-name-exclude); accesses inside a workspace's own
bounds (a plugin's sub-buffers are one allocation to the tool), and a later call in the same
test that needs less workspace than its first; memcheck sees the TMA's bulk copies and the
warpgroup MMAs only where this compute-sanitizer has --check-bulk-copy and --check-warpgroup-mma
(used when its --help lists them; the log's first line says which); racecheck sees shared-memory
hazards between threads (not those of the TMA, whose writes belong to no thread), synccheck
barrier misuse, initcheck global reads of memory never written since its allocation (a workspace
is zeroed when made).

    python3 scripts/gpu_sanitize.py [--tools memcheck,racecheck] [--timeout memcheck=240,...] [--out DIR]
                                    [--sanitizer PATH] [-k EXPR] [--wide] [--list]

Exit status: 0 every tool passed; 1 a tool failed (a planted fault not seen, a sanitizer error,
a failing or skipped test, no test run, a timeout); 2 bad arguments, no compute-sanitizer, a
factor library not built, or no CuPy / GPU.
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
# each tool's pytest arguments (after -m gpu). Paces seen on an H100 (2026-12-07, first with
# CuPy's kernels still checked: synccheck 136 tests in 34 s, memcheck about 3 s a test,
# initcheck 4-7 s, racecheck 10-20 s; then with them excluded: memcheck 136 tests in 45 s,
# synccheck in 22 s, racecheck's 38 in 94 s, initcheck not one test in 140 s, CUB's reduce
# reports filling its log). So each tool runs the small set (136 tests), racecheck the forced
# configurations on one shape and topk_softmax's plugin tests (38); --wide gives
# memcheck test_gpu.py's wider selection too (WIDE: the registry's own choices on the awkward
# shapes, the model shapes at T = 1 and 64, bfloat16, and the tests of invalid ids, unaligned
# sizes, one hot expert, no valid slot and empty batches: 311 tests, 122-136 s in one process
# until it ran out of memory; now in 20 processes, group_ids)
RACE_KINDS = "one_expert"
TESTS = {
    "memcheck": SMALL,
    "racecheck": SMALL[:-1] + [f"(test_moe_every_config and ({RACE_KINDS})) or test_topk_softmax_plugin"],
    "synccheck": SMALL,
    "initcheck": SMALL,
}
WIDE = ["tests/test_gpu_configs.py", "tests/test_gpu.py", "-k",
        "test_moe_every_config or test_topk_softmax_plugin or test_fused_add_rmsnorm_plugin "
        "or test_moe_plugin_awkward or test_moe_unaligned or test_moe_skewed_and_single "
        "or test_moe_out_of_range_ids_are or test_moe_empty_batch or test_moe_decode_with_no_valid_slot "
        "or (test_moe_plugin_on_model_shapes and bfloat16)"]


# the tests' command (collected, or run under the sanitizer): the GPU tests only
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]


def collect_ids(args, env):
    """The node ids pytest selects with ``args`` (``-m gpu``; collected without the sanitizer),
    or [] where collection fails."""
    try:
        r = subprocess.run([*PYTEST, "--collect-only", *args], capture_output=True, text=True, encoding="utf-8",
                           errors="replace", cwd=ROOT, env=env, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    # the ids come first, one a line, up to a blank line (a warnings summary after it names ids again)
    ids = []
    for line in r.stdout.splitlines():
        if not line.strip():
            break
        if "::" in line:
            ids.append(line.strip())
    return list(dict.fromkeys(ids))


def group_ids(ids):
    """``ids`` in groups, each for a process of its own, in the order given: one per test
    function, but one per model for test_moe_plugin_on_model_shapes ('...[T-model-dtype]') and
    one per shape for test_moe_decode_with_no_valid_slot_writes_zeros ('...[T-H-E-I-K-mode]').
    Why: under memcheck with the pool off, most of the device memory the tests free is not
    given back (an H100, 2026-12-07: free memory fell with each test, by an amount that grew with
    its sizes, 310-318 MiB a forced case at E = 40, 7456 MiB at deepseek T = 1, the same on
    both plugins and every configuration, 0-56 MiB on the router and norm tests; with the pool
    on, the GPU suite's 747 tests, these among them, passed in one process), so the wide set ran
    out of the card's 80 GB in one process, at mixtral T = 1; the forced cases took 55908 MiB
    in all."""
    groups = {}
    for i in ids:
        fn, _, params = i.partition("[")
        params = params.rstrip("]")
        key = fn
        if fn.endswith("::test_moe_plugin_on_model_shapes") and params.count("-") >= 2:
            key = (fn, params.split("-", 1)[1].rsplit("-", 1)[0])      # the model
        elif fn.endswith("::test_moe_decode_with_no_valid_slot_writes_zeros") and "-" in params:
            key = (fn, params.rsplit("-", 1)[0])                         # the shape, not the mode
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def judge_all(runs, timeout, n_groups):
    """judge() of each of ``runs`` ((status or None, text) of one process each, of ``n_groups``
    groups) made one row: the tests summed, the sanitizer's errors summed, the first verdict
    that is not clean (naming its group) or "clean"; a run stopped at the timeout, or groups
    left unrun, make it "stopped"."""
    read = [read_run(rc, text, timeout) for rc, text in runs]
    counts = {}
    for c, _, _ in read:
        for k, n in c.items():
            counts[k] = counts.get(k, 0) + n
    stopped = runs[-1][0] is None or len(runs) < n_groups
    summaries = [line for _, line, _ in read]
    errors = [int(m.group(1)) for line in summaries if (m := re.match(r"ERROR SUMMARY: (\d+) error", line))]
    summary = (f"ERROR SUMMARY: {sum(errors)} errors ({len(runs)} processes)" if len(errors) == len(read)
               else "; ".join(dict.fromkeys(summaries)))
    bad = [(i, verdict) for i, (_, _, verdict) in enumerate(read, 1) if verdict != "clean"]
    if stopped:
        verdict = f"stopped after {timeout} s ({len(runs)} of {n_groups} processes started)"
    elif bad:
        verdict = f"{bad[0][1]} (process {bad[0][0]} of {n_groups})"
    else:
        verdict = "clean"
    return tests_text(counts, stopped), summary, verdict


def selection(tool, k=None, wide=False):
    """The pytest arguments of ``tool``: TESTS (memcheck with --wide: WIDE), narrowed by the
    -k expression ``k``."""
    args = WIDE if wide and tool == "memcheck" else TESTS[tool]
    return list(args) if not k else args[:-1] + [f"({args[-1]}) and ({k})"]


# each tool's planted defects (--plant NAME, one process each), and words its report must contain
PLANTED = {
    "memcheck": [("oob", "a write one float past a 1000-float array", r"Invalid __global__ write"),
                 ("plugin", "moe_fused_gemm.so given an output one row short", r"Invalid __global__ write")],
    "racecheck": [("race", "two warps writing one shared word, no barrier",
                   r"RACECHECK SUMMARY: [1-9]\d* hazards?|Race reported")],
    "synccheck": [("badsync", "a __syncwarp whose mask leaves out the calling lanes",
                   r"[Bb]arrier error|Invalid arguments")],
    "initcheck": [("uninit", "a read of global memory never written", r"Uninitialized __global__ memory read")],
}
PLANTS = [name for plants in PLANTED.values() for name, _, _ in plants]
# options a tool gets where this compute-sanitizer's --help lists them
EXTRA = {"memcheck": [("--padding", "65536"), ("--check-bulk-copy", "yes"), ("--check-warpgroup-mma", "yes")],
         "racecheck": [("--racecheck-memcpy-async", "yes")]}
# kernels not checked: CuPy's own (its elementwise, reduction and scan kernels are named cupy_*,
# its sorts are thrust's, its reductions over an axis CUB's device-wide kernels, in CUB's
# versioned namespace CUB_<version>_SM_...), which the tests' inputs and float64 references run.
# Our kernels use CUB's block scans inside their own code, so no name of ours holds CUB_.
# On the first runs (an H100, 2026-12-07) initcheck reported thrust's merge sort (cp.argsort) in
# both, racecheck CuPy's nonzero scan (warnings) in the first, 50 reports each, the print limit,
# which would hide a later report of ours; with those excluded, the next initcheck run's 200
# reports were all CUB's segmented reduce (the tests' w.sum(1)).
# (--kernel-name-exclude, as compute-sanitizer 2025.3 spells it: it has no --exclude)
EXCLUDE = ["--kernel-name-exclude", "kns=cupy_", "--kernel-name-exclude", "kns=thrust",
           "--kernel-name-exclude", "kns=CUB_"]
# words of a sanitizer that did not check (a device or an instruction it does not support)
BROKEN = r"Internal Sanitizer Error|Device not supported|not supported on this (?:device|platform)"
# words of a sanitizer whose target (pytest) failed or died
TARGET_FAILED = r"Target application returned an error|process didn't terminate successfully"
LIBS = ("moe_fused_gemm.so", "moe_fused_gemm_sm90.so", "topk_softmax.so", "fused_add_rmsnorm.so")
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


def plant(name):
    """Run the planted defect ``name`` (of PLANTS; this process is the one under the sanitizer)."""
    import cupy as cp
    cp.cuda.set_allocator(None)        # each array its own cudaMalloc, as in the tests
    n = 1000
    if name == "plugin":               # the plugin's combine writes row T-1 of out, past the array
        st = runpy.run_path(str(ROOT / "scripts" / "gpu_moe_selftest.py"))
        fac, dt = st["Factor"](str(ROOT / "factors" / "moe_fused_gemm.so")), st["Dt"]("bf16")
        T, H, E, I, K = 4, 256, 8, 128, 2
        x, w13, w2, tw, ids = st["make_inputs"](dt, T, H, E, I, K, None)
        dims = [T, H, E, I, K, dt.code]
        ws = cp.zeros(max(fac.workspace_size(dims), 256), cp.uint8)
        out = cp.zeros((T - 1) * H, cp.uint16)
        aux = [None, w13.data.ptr, w2.data.ptr, tw.data.ptr, ids.data.ptr, ws.data.ptr]
        rc, path = fac.call(out.data.ptr, x.data.ptr, aux, dims, cp.cuda.get_current_stream().ptr)
        print(f"plugin call: status {rc}, path {path}")
    else:
        mod = cp.RawModule(code=KERNELS)
        if name == "oob":
            a = cp.zeros(n, cp.float32)
            mod.get_function("oob")((4,), (256,), (a, cp.int32(n)))
        elif name == "race":
            out = cp.zeros(64, cp.float32)
            mod.get_function("race")((1,), (64,), (out,))
        elif name == "badsync":
            out = cp.zeros(32, cp.float32)
            mod.get_function("badsync")((1,), (32,), (out,))
        else:
            a, b = cp.empty(n, cp.float32), cp.zeros(n, cp.float32)
            mod.get_function("uninit")((4,), (256,), (a, b, cp.int32(n)))
    cp.cuda.Device().synchronize()
    print(f"planted {name} defect ran")
    return 0


def parse_timeouts(text):
    """{tool: seconds} of --timeout: "150" (every tool) or "memcheck=240,racecheck=90" (the tools
    not named 540); None where it is neither, or a value is below 1."""
    out = dict.fromkeys(TOOLS, 540)
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


def tests_text(counts, so_far):
    """'N passed, N failed, N skipped[, N errors][ so far]' of pytest's ``counts``."""
    return (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped"
            + (f", {counts['error']} errors" if counts.get("error") else "") + (" so far" if so_far else ""))


def judge(rc, text, timeout):
    """(tests, sanitizer summary, verdict) of one tool's pytest run under the sanitizer (read_run)."""
    counts, summary, verdict = read_run(rc, text, timeout)
    return tests_text(counts, rc is None), summary, verdict


def read_run(rc, text, timeout):
    """(pytest's counts, sanitizer summary, verdict) of one pytest run under the sanitizer: rc its exit
    status (None: stopped at ``timeout`` s), text its output. verdict is "clean" only where pytest
    passed (at least one test, none skipped), the sanitizer's summary says 0 errors, its status is
    not ERROR_STATUS, it said nothing of an internal error or an unsupported device, and the run
    says CuPy's pool was off. A run stopped at the timeout counts the
    tests of pytest's progress lines ('..F.s [ 12%]', the last one without its percentage) so far."""
    # pytest's last summary line ("1 failed, 7 passed, 2 skipped in 12.0s"), not any such words
    # a test printed
    final = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected)\b[^\n]*) in [\d.]+s\b", text, re.M)
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)\b", final[-1] if final else "")}
    if rc is None:   # no summary line: what the progress lines show
        # (a sanitizer report may follow a test's mark on its line: '.========= Warning: ...')
        marks = "".join(m for m in re.findall(r"^([.FEsx]+)(?=\s*\[\s*\d+%\]\s*$|\s*$|=========)", text, re.M))
        counts = {"passed": marks.count("."), "failed": marks.count("F") + marks.count("E"),
                  "skipped": marks.count("s")}
    lines = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: [^\n]*", text)
    # memcheck, synccheck, initcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY:
    # 0 hazards displayed (0 errors, 0 warnings)" (its warnings, hazards it deems possibly benign,
    # fail too: the kernels left after EXCLUDE are ours)
    # every summary counts, not the first: a process of its own (--target-processes all) has one
    races = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warning", text)
    errors = [int(e) for e, _ in races] + [int(e) for e in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    n_err = sum(errors) if errors else None
    warnings = sum(int(w) for _, w in races)
    died = re.search(TARGET_FAILED, text)
    if rc is None:
        verdict = f"stopped after {timeout} s"
    elif rc == ERROR_STATUS or (n_err or 0) > 0:
        verdict = "sanitizer errors"
    elif broken := re.search(BROKEN, text):
        verdict = "the sanitizer did not check: " + broken.group(0)
    elif rc != 0:
        verdict = f"tests failed (status {rc})"
    elif counts.get("failed") or counts.get("error") or died:
        # status 0, yet pytest or the sanitizer says the tests' process failed
        verdict = "tests failed (" + (died.group(0) if died else "pytest's summary") + ", status 0)"
    elif not counts.get("passed"):
        verdict = "no test ran"
    elif counts.get("skipped"):
        verdict = f"{counts['skipped']} tests skipped (not checked)"
    elif "CuPy memory pool off" not in text:
        verdict = "CuPy's pool was not off"
    elif n_err is None:
        verdict = "no sanitizer summary"
    elif warnings:
        verdict = f"{warnings} racecheck warnings (hazards it deems possibly benign: read the log)"
    else:
        verdict = "clean"
    return counts, (lines[-1] if lines else "no summary line"), verdict


def sanitizer_help(san):
    """The text of ``san --help`` ('' where it cannot be run)."""
    try:
        return subprocess.run([san, "--help"], capture_output=True, text=True, encoding="utf-8", errors="replace",
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def extra_options(help_text, tool):
    """EXTRA[tool]'s options that the sanitizer's --help text lists, and EXCLUDE where it lists
    --kernel-name-exclude, as arguments."""
    listed = [x for opt, value in EXTRA.get(tool, []) if re.search(re.escape(opt) + r"\b", help_text)
              for x in (opt, value)]
    return listed + (EXCLUDE if re.search(r"--kernel-name-exclude\b", help_text) else [])


def read_from(log, start):
    """The text of ``log`` from byte ``start`` on (what the last command appended)."""
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", errors="replace")


def least_free(memory_log):
    """'; least free device memory after a test: N of M MiB (test id)' from the lines
    tests/conftest.py appends to ``memory_log`` ('<id> free <N> of <M> MiB'), or '' where none."""
    try:
        text = Path(memory_log).read_text(encoding="utf-8")
    except OSError:
        return ""
    seen = [(int(m.group(2)), m.group(3), m.group(1)) for m in re.finditer(r"^(.*) free (\d+) of (\d+) MiB$", text, re.M)]
    if not seen:
        return ""
    free, total, test = min(seen)
    return f"; least free device memory after a test: {free} of {total} MiB ({test})"


def check_tool(tool, san, help_text, a):
    """One row of the table: (tool, planted, tests, sanitizer summary, seconds, ok, verdict)."""
    log = Path(a.out) / f"sanitize_{tool}.txt"
    extra = extra_options(help_text, tool)
    log.write_text(f"options beyond --tool {tool}: {' '.join(extra) or 'none'} (EXTRA: "
                   f"{' '.join(o for o, _ in EXTRA.get(tool, [])) or 'none'})\n", encoding="utf-8")
    base = [san, "--tool", tool, "--error-exitcode", str(ERROR_STATUS), "--print-limit", "200", *extra]
    missed, t_plant = [], 0.0
    for name, what, words in PLANTED[tool]:
        start = log.stat().st_size
        rc, secs = run(base + [sys.executable, __file__, "--plant", name], log, 120)
        t_plant += secs
        text = read_from(log, start)
        seen = rc == ERROR_STATUS and re.search(words, text) is not None
        if not seen:
            missed.append(name)
        print(f"  {tool}: planted {what}: {'seen' if seen else f'NOT SEEN (status {rc})'} ({secs:.0f} s)", flush=True)
    planted = "seen" if not missed else f"NOT SEEN: {', '.join(missed)}"
    memory_log = Path(a.out) / f"sanitize_{tool}_memory.txt"
    memory_log.write_text("", encoding="utf-8")
    env = dict(os.environ, EX_TEST_NO_MEMORY_POOL="1", PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               EX_TEST_MEMORY_LOG=str(memory_log),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    args = selection(tool, a.k, a.wide)
    groups = [args]
    if a.wide and tool == "memcheck":   # a process per group (group_ids says why)
        groups = group_ids(collect_ids(args, env)) or [args]
    runs, secs, limit = [], 0.0, a.timeouts[tool]
    for g in groups:
        start = log.stat().st_size
        rc, took = run(base + [*PYTEST, "-rfEs", *g], log, max(1, limit - secs), env)
        secs += took
        runs.append((rc, read_from(log, start)))
        if rc is None or secs >= limit:
            break
    if len(groups) == 1:
        tests, summary, verdict = judge(runs[0][0], runs[0][1], limit)
    else:
        tests, summary, verdict = judge_all(runs, limit, len(groups))
    ok = not missed and verdict == "clean"
    print(f"  {tool}: {tests}; {summary}; {verdict} ({secs:.0f} s){least_free(memory_log)}", flush=True)
    if missed:
        verdict = f"planted fault not seen; tests {verdict}"
    return tool, planted, tests, summary, secs + t_plant, ok, verdict


def usage(message):
    """Say ``message`` on stderr as this script's error and give the exit status of bad usage (2)."""
    print(f"gpu_sanitize: {message}", file=sys.stderr)
    return 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated compute-sanitizer tools to run")
    ap.add_argument("--timeout", default="540",
                    help="seconds for each tool's tests: one number for all, or tool=seconds pairs "
                         "(a tool not named: 540); on a machine lent 600 s a call, one tool a call")
    ap.add_argument("--out", default=str(ROOT / "gpu_out"), help="folder of the logs (sanitize_<tool>.txt)")
    ap.add_argument("--sanitizer", default=None, help="compute-sanitizer executable (default: PATH, then CUDA's bin/)")
    ap.add_argument("-k", default=None, help="narrow each tool's selection by this pytest -k expression")
    ap.add_argument("--wide", action="store_true", help="memcheck also runs test_gpu.py's wider selection (WIDE), "
                    "in a process per test function (per model, per decode shape: group_ids)")
    ap.add_argument("--list", action="store_true", help="print each tool's pytest arguments and stop")
    ap.add_argument("--plant", choices=PLANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plant:
        return plant(a.plant)
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        return usage(f"--tools: expected some of {','.join(TOOLS)}, comma-separated, got {a.tools!r}")
    timeouts = parse_timeouts(a.timeout)
    if timeouts is None:
        return usage(f"--timeout: expected seconds >= 1, or tool=seconds pairs of {','.join(TOOLS)} "
                     f"(e.g. memcheck=240,racecheck=90), got {a.timeout!r}")
    a.timeouts = timeouts
    if a.list:
        for t in tools:
            args = selection(t, a.k, a.wide)
            print(f"{t} ({timeouts[t]} s): pytest -m gpu " + " ".join(f"'{x}'" if " " in x else x for x in args))
        return 0
    san = find_sanitizer(a.sanitizer)
    if san is None:
        return usage(f"--sanitizer: expected a compute-sanitizer executable, got "
                     f"{a.sanitizer or 'none on PATH or in /usr/local/cuda*/bin'}")
    missing = [lib for lib in LIBS if not (ROOT / "factors" / lib).is_file()]
    if missing:
        return usage(f"expected the built factors in {ROOT / 'factors'}, missing {', '.join(missing)} "
                     "(run make, or gpu_check.sh's build stage, first)")
    cupy, why = _scripts["cupy_with_gpu"]()
    if cupy is None:
        return usage(f"needs CuPy and a CUDA GPU: {why}")
    try:
        Path(a.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return usage(f"--out: cannot make the log folder {a.out}: {exc}")
    print(f"compute-sanitizer: {san}; tools: {', '.join(tools)}; logs in {a.out}", flush=True)
    help_text = sanitizer_help(san)
    rows = []
    for i, t in enumerate(tools, 1):
        print(f"[{i}/{len(tools)}] {t} ...", flush=True)
        rows.append(check_tool(t, san, help_text, a))
    print("\n| tool | planted fault | tests | sanitizer | s | result |\n| --- | --- | --- | --- | ---: | --- |")
    for tool, planted, tests, summary, secs, ok, verdict in rows:
        print(f"| {tool} | {planted} | {tests} | {summary} | {secs:.0f} | {'PASS' if ok else 'FAIL: ' + verdict} |")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    _scripts["exit_quietly_on_broken_pipe"](main)
