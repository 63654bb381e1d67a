"""Session 35's plugin-author trial of the loader (helpers, no GPU): each defect it found has a
test here."""
import re

import numpy as np
import pytest

from ex_engine import FactorRegistry
from ex_engine.errors import FactorError
from ex_engine.manifest import Manifest
from tests.conftest import ROOT, build_plugin

HOST_SCALE_YAML = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
OUT = "output: {name: out, shape: [N], dtype: [float32]}"
IN = "input: {name: x, shape: [N], dtype: [float32]}"


def _manifest(tmp_path, text, stem="host_scale"):
    p = tmp_path / f"{stem}.yaml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("old,new,field", [
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: input}", "output: role"),
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: inout}", "output: role"),
    (OUT, "output: {name: out, shape: [N], dtype: [float32], role: workspace}", "output: role"),
    (IN, "input: {name: x, shape: [N], dtype: [float32], role: output}", "input: role"),
    (IN, "input: {name: x, shape: [N], dtype: [float32], role: inout}", "input: role"),
])
def test_the_output_and_input_keep_their_roles(tmp_path, old, new, field):
    """output: {..., role: input} turned off the checks of what the kernel writes: a read-only
    memmap given as out was written by the kernel (SIGSEGV). The role of output and input is
    the one their place in the ABI gives them."""
    path = _manifest(tmp_path, HOST_SCALE_YAML.replace(old, new))
    with pytest.raises(FactorError, match=rf"manifest {path}: {field}: expected"):
        Manifest.load(path)


def test_a_read_only_output_is_refused_not_written(tmp_path):
    build_plugin(tmp_path)
    (tmp_path / "host_scale.yaml").write_text(HOST_SCALE_YAML.replace(
        OUT, "output: {name: out, shape: [N], dtype: [float32], role: input}"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and "host_scale.yaml: output: role: expected output" in p.reason, p.reason


def _fifo(path):
    import os
    os.mkfifo(path)
    return path


def test_a_fifo_or_an_oversized_file_is_refused_unread(tmp_path, monkeypatch):
    """A manifest, lock file, hardware profile or tuning file that was a FIFO blocked the read
    forever (/dev/zero filled memory): each is refused as not a regular file before anything
    is read, and one over the size limit with its size named."""
    import threading

    from ex_engine import _paths, manifest, trust
    from ex_engine.hardware import Hardware
    from ex_engine.tuning import TuningTable

    def soon(fn, *args):   # fn(*args), failing the test instead of hanging it
        got = {}

        def run():
            try:
                got["value"] = fn(*args)
            except BaseException as exc:   # the refusal, for the caller's pytest.raises
                got["exc"] = exc
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), f"{fn.__qualname__} blocked on a FIFO"
        if "exc" in got:
            raise got["exc"]
        return got.get("value")

    fifo = _fifo(tmp_path / "x.yaml")
    with pytest.raises(FactorError, match=rf"manifest {fifo}: not a regular file \(a FIFO\)"):
        soon(manifest.read_manifest_bytes, fifo)
    with pytest.raises(FactorError, match=r"not a regular file \(a FIFO\)"):
        soon(manifest.load_all, tmp_path)
    with pytest.raises(FactorError, match=rf"lock file {fifo}: not a regular file \(a FIFO\)"):
        soon(trust.read_lock, fifo)
    with pytest.raises(FactorError, match=rf"hardware profile {fifo}: not a regular file \(a FIFO\)"):
        soon(Hardware.from_profile, str(fifo))
    assert soon(manifest.why_not_found, fifo, "x") == ""
    with pytest.raises(FactorError, match=r"lock file /dev/zero: not a regular file \(a character device\)"):
        soon(trust.read_lock, "/dev/zero")

    tdir = tmp_path / "t"
    tdir.mkdir()
    _fifo(tdir / "h200.yaml")
    t = soon(TuningTable.for_hardware, Hardware.from_profile("h200"), tdir, False)
    assert t.unreadable == [str(tdir / "h200.yaml")]
    assert any("not a regular file (a FIFO)" in p for p in t.problems), t.problems

    monkeypatch.setattr(_paths, "TEXT_FILE_LIMIT", 1000)
    monkeypatch.setattr(_paths.read_small, "__defaults__", (1000,))
    big = tmp_path / "big"
    big.mkdir()
    (big / "host_scale.yaml").write_text(HOST_SCALE_YAML + "#" * 2000 + "\n", encoding="utf-8")
    with pytest.raises(FactorError, match=r"manifest .*host_scale\.yaml: 2.\d\d KiB \(2\d\d\d bytes\), over the "
                                          r"limit of 1000 B"):
        manifest.load_all(big)
    (big / "lk.json").write_text("{}" + " " * 2000, encoding="utf-8")
    with pytest.raises(FactorError, match=r"lock file .*lk\.json: .*over the limit of 1000 B"):
        trust.read_lock(big / "lk.json")


def test_a_huge_library_is_refused_by_its_size_and_the_others_load(tmp_path, capsys):
    """A 40 GB *.so (truncate -s 40G) made FactorRegistry.load raise MemoryError (the whole file
    was read to hash it; only OSError was caught), and `ex-engine lock` likewise: it is refused
    by its size, unread, and the other libraries load; the lock leaves it out, saying why."""
    import os

    from ex_engine import trust
    from ex_engine.cli import main as cli_main
    build_plugin(tmp_path)
    huge = tmp_path / "huge.so"
    with open(huge, "wb") as fh:
        fh.truncate(40 << 30)   # sparse: no disk used
    assert os.stat(huge).st_size == 40 << 30
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    st = {p.path.name: p for p in reg.plugins}
    assert st["huge.so"].status == "rejected"
    assert st["huge.so"].reason == ("read: 40.00 GiB (42949672960 bytes), over the limit of 2.00 GiB: not read "
                                    "(no plugin library is that large)"), st["huge.so"].reason
    assert reg.get("host_scale").status == "ready"
    assert list(trust.lock_digests(tmp_path)) == ["host_scale.so"]
    assert cli_main(["lock", "--dir", str(tmp_path)]) == 0
    assert "note: huge.so left out: 40.00 GiB, over the limit of 2.00 GiB for a library" in capsys.readouterr().out
    reg = FactorRegistry.load(tmp_path, hardware="h200", lock=True)
    assert reg.get("host_scale").status == "ready"


def test_the_library_hash_is_read_in_chunks(tmp_path):
    """Where only a digest is needed (the lock, a file compared after dlopen) the file is hashed
    in chunks, not read whole; a FIFO is refused, not waited on."""
    import hashlib
    import os

    from ex_engine import _paths, trust
    data = os.urandom(3 << 20)
    f = tmp_path / "x.so"
    f.write_bytes(data)
    assert trust.sha256_file(f) == hashlib.sha256(data).hexdigest()
    assert trust.lock_digests(tmp_path) == {"x.so": hashlib.sha256(data).hexdigest()}
    with pytest.raises(_paths.FileRefused, match="over the limit of 1.00 MiB"):
        trust.sha256_file(f, 1 << 20)
    with pytest.raises(_paths.FileRefused, match=r"not a regular file \(a FIFO\)"):
        trust.sha256_file(_fifo(tmp_path / "p.so"))


@pytest.mark.parametrize("old,new,needle", [
    (IN, "input: {name: x, shape: [N]}", "x: dtype: expected a non-empty list"),
    (IN, "input: {name: x, shape: [N], dtype: []}", "x: dtype: expected a non-empty list"),
    ("{name: alpha, shape: [1], dtype: [float32], role: input}", "{name: alpha, shape: [1], role: input}",
     "alpha: dtype: expected a non-empty list"),
    # several dtypes, no dim saying which: a float16 x ran the float32 kernel (a heap overflow)
    (IN, "input: {name: x, shape: [N], dtype: [float32, float16]}", "x: dtype: ['float32', 'float16'] allows "
     "several dtypes, but no dim tells the kernel which"),
    # tied to another array, but no dim says the dtype of either
    (OUT + "\n" + IN, "output: {name: out, shape: [N], dtype: [float32, float16]}\n"
     "input: {name: x, shape: [N], dtype: [float32, float16], same_dtype_as: out}", "out: dtype: ['float32', 'float16'] allows "
     "several dtypes, but no dim tells"),
    # tied only to an optional array (absent in some calls, so no dim source can name it)
    ("{name: alpha, shape: [1], dtype: [float32], role: input}",
     "{name: alpha, shape: [1], dtype: [float32, float16], role: input, same_dtype_as: y}\n"
     "  - {name: y, shape: [N], dtype: [float32, float16], role: input, optional: true}",
     "alpha: dtype: ['float32', 'float16'] allows several dtypes"),
])
def test_an_array_of_no_dtype_or_of_several_untold_dtypes_is_refused(tmp_path, old, new, needle):
    path = _manifest(tmp_path, HOST_SCALE_YAML.replace(old, new))
    with pytest.raises(FactorError, match=rf"manifest {path}: " + re.escape(needle)):
        Manifest.load(path)


@pytest.mark.parametrize("old,new", [
    # a dim gives x's dtype code
    (IN, "input: {name: x, shape: [N], dtype: [float32, float16]}\ndim_sources: {dt: {dtype_of: x}}"),
    # ... and out is tied to x, in either direction
    (OUT, "output: {name: out, shape: [N], dtype: [float32, float16], same_dtype_as: x}\n"
          "dim_sources: {dt: {dtype_of: x}}"),
    (IN, "input: {name: x, shape: [N], dtype: [float32, float16], same_dtype_as: out}\n"
         "dim_sources: {dt: {dtype_of: out}}"),
    # tied to an array of a single dtype, which fixes it
    (IN, "input: {name: x, shape: [N], dtype: [float32, float16], same_dtype_as: out}"),
    # an optional array of several dtypes (moe_fused_gemm's router_logits, which the kernel does not read)
    ("{name: alpha, shape: [1], dtype: [float32], role: input}",
     "{name: alpha, shape: [1], dtype: [float32], role: input}\n"
     "  - {name: y, shape: [N], dtype: [float32, float16], role: input, optional: true}"),
])
def test_several_dtypes_load_where_a_dim_tells_the_kernel(tmp_path, old, new):
    text = HOST_SCALE_YAML.replace(old, new)
    if "dtype_of" in new:
        text = text.replace("dims: [N]", "dims: [N, dt]")
    Manifest.load(_manifest(tmp_path, text))


def test_the_shipped_manifests_and_the_template_still_load():
    from ex_engine import manifest
    assert set(manifest.load_all(ROOT / "manifests")) == {"fused_add_rmsnorm", "moe_fused_gemm", "topk_softmax"}
    assert Manifest.load(ROOT / "docs" / "template" / "my_op.yaml").name == "my_op"


def test_a_library_that_writes_the_hardware_description_changes_no_other_library(tmp_path):
    """ex_get_factor's hardware struct was one for every library: a library writing through its
    const pointer (warp_size = 64) made the libraries loaded after it see other hardware
    (host_scale's num_warps then broke the tuning check). Each call gets its own copy, and the
    library that changed its copy is refused, naming the field."""
    build_plugin(tmp_path, "a_mut", defines={"MUTATE_HW": 64, "NAME": '"host_scale_mut"', "FACTOR_ID": 1101})
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert [p.path.name for p in reg.plugins] == ["a_mut.so", "host_scale.so"]
    mut = reg.plugins[0]
    assert mut.status == "rejected" and mut.reason == (
        "hardware unchanged: ex_get_factor wrote to the hardware description it was given (a const "
        "ex_hardware_t*): warp_size: 32 -> 64; a library must only read it"), mut.reason
    assert reg.get("host_scale").status == "ready", reg.plugins[1].reason
    assert reg._hw_c.warp_size == 32


def test_the_note_of_a_factor_whose_fallback_cannot_be_loaded_says_its_calls_raise(tmp_path):
    """Every library rejected because the manifest's fallback does not import: the note said
    "its calls go to the Python fallback nosuch_mod:scale", and every call raised."""
    import shutil

    from ex_engine import _paths
    m = tmp_path / "m"
    shutil.copytree(_paths.manifests_dir(), m)
    (m / "host_scale.yaml").write_text(HOST_SCALE_YAML.replace("tests.plugins.host_scale_fallback:scale",
                                                               "nosuch_mod:scale"), encoding="utf-8")
    build_plugin(tmp_path / "lib", manifest=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m)
    (p,) = reg.plugins
    assert p.status == "rejected" and "fallback 'nosuch_mod:scale' cannot be loaded" in p.reason, p.reason
    notes = [n for n in reg.notes if n.startswith("fallback:")]
    assert notes == [f"fallback: host_scale: no ready plugin: host_scale.so was rejected ({p.reason}); its "
                     "Python fallback nosuch_mod:scale cannot be loaded, so its calls raise FactorError "
                     "unless set_fallback gives it a Python fallback; see list-factors --why"], notes
    x = np.ones(4, np.float32)
    with pytest.raises(FactorError, match="cannot be loaded"):
        reg.dispatch("host_scale", {"x": x, "out": np.empty_like(x), "alpha": np.ones(1, np.float32)})


def _host_scale_call(reg):
    x = np.arange(1, 5, dtype=np.float32)
    out = np.empty_like(x)
    return reg.dispatch("host_scale", {"x": x, "out": out, "alpha": np.full(1, 2, np.float32)}), x, out


def test_a_fallback_that_exits_is_a_factor_error_but_ctrl_c_stays(tmp_path):
    """sys.exit() in a Python fallback at call time reached the caller as SystemExit (ending
    the program); the contract says a fallback's exception reaches the caller as FactorError."""
    import sys
    build_plugin(tmp_path, defines={"BEHAVIOUR": 2})   # both C paths decline
    reg = FactorRegistry.load(tmp_path, hardware="h200")

    def exits(arrays, sizes, params):
        sys.exit(3)

    def interrupted(arrays, sizes, params):
        raise KeyboardInterrupt

    reg.set_fallback("host_scale", exits)
    with pytest.raises(FactorError, match=r"host_scale: the Python fallback set with set_fallback \(.*exits\) "
                                          r"raised SystemExit: 3"):
        _host_scale_call(reg)
    reg.set_fallback("host_scale", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _host_scale_call(reg)
    assert reg.stats()["host_scale"]["errors"] == 1


def test_a_version_of_other_scripts_digits_is_refused(tmp_path):
    """_SEMVER's \\d took any script's digits: "١.٠.٠" (Arabic-Indic) loaded, and ordered as 1.0.0."""
    build_plugin(tmp_path, defines={"VERSION": '"\u0661.\u0660.\u0660"'})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.plugins[0]
    assert p.status == "rejected" and p.reason.startswith("version is MAJOR.MINOR.PATCH: expected three "
                                                          "dot-separated numbers"), p.reason


def test_a_lock_file_that_names_a_library_twice_is_refused(tmp_path):
    """json kept the last of two entries for one library silently; YAML files refuse a key
    given twice, and so does a lock file now."""
    from ex_engine import trust
    a, b = "a" * 64, "b" * 64
    lk = tmp_path / "ex_engine.lock"
    lk.write_text(f'{{"x.so": "{a}", "x.so": "{b}"}}', encoding="utf-8")
    with pytest.raises(FactorError, match=rf"lock file {lk}: found duplicate key 'x.so': expected each library once"):
        trust.read_lock(lk)
    lk.write_text(f'{{"x.so": "{a}", "y.so": "{b}"}}', encoding="utf-8")
    assert trust.read_lock(lk) == {"x.so": a, "y.so": b}


def test_a_manifest_fallback_that_leaves_outputs_unwritten_is_an_error_as_set_fallbacks_is(tmp_path, monkeypatch):
    """The same function returned 'python_fallback' with the poison still in out when the
    manifest named it, and raised "left ... unwritten" when given by set_fallback."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "trial6_half_fallback.py").write_text(
        "def half(arrays, sizes, params):\n"
        "    arrays['out'].raw()[:2] = arrays['x'].raw()[:2]\n")
    monkeypatch.syspath_prepend(str(mods))
    build_plugin(tmp_path, defines={"BEHAVIOUR": 2})   # both C paths decline
    (tmp_path / "host_scale.yaml").write_text(HOST_SCALE_YAML.replace(
        "tests.plugins.host_scale_fallback:scale", "trial6_half_fallback:half"), encoding="utf-8")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale").status == "ready"
    with pytest.raises(FactorError, match=r"host_scale: the Python fallback 'trial6_half_fallback:half' \(manifest "
                                          r".*host_scale\.yaml\) left out: 2 of 4 element\(s\) unwritten"):
        _host_scale_call(reg)
    import trial6_half_fallback
    reg.set_fallback("host_scale", trial6_half_fallback.half)
    with pytest.raises(FactorError, match=r"set with set_fallback \(half\) left out: 2 of 4 element\(s\) unwritten"):
        _host_scale_call(reg)
    assert reg.stats()["host_scale"]["errors"] == 2
    reg.set_fallback("host_scale", None)
    (tmp_path / "host_scale.yaml").write_text(HOST_SCALE_YAML, encoding="utf-8")   # (a fallback that writes all: served)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    path, x, out = _host_scale_call(reg)
    assert path == "python_fallback" and (out == 2 * x).all()
