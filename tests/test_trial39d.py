"""Session 39's new user's trial (a helper on a clean clone, no GPU): what it found, mended."""
import pytest

from ex_engine import FactorError
from ex_engine.moe_layer import load_models


def test_a_missing_model_list_is_called_missing_not_malformed(tmp_path):
    """A model list that is not there read 'malformed or unreadable (FileNotFoundError ...)':
    the file is missing, and the message now says so; a file that cannot be read is
    'unreadable', and one that is not YAML still 'malformed'."""
    with pytest.raises(FactorError, match=r"model list .*nowhere\.yaml: missing \(FileNotFoundError"):
        load_models(tmp_path / "nowhere.yaml")
    with pytest.raises(FactorError, match=r"model list .*: unreadable \(IsADirectoryError"):
        load_models(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(FactorError, match=r"model list .*bad\.yaml: malformed \("):
        load_models(bad)


def test_make_q_answers_up_to_date_once_built_and_a_name_with_two_sources_still_fails(tmp_path):
    """`make -q` exited 1 right after a full build (the nvcc and source checks were phony
    prerequisites of every library, always 'out of date'): it now exits 0 when every library is
    built and 1 when a source is newer. The checks run in each library's recipe instead; a
    factor name with two sources is refused even where its library is up to date."""
    import os
    import shutil
    import subprocess
    import time

    from tests.test_factors_build import ROOT, _project_copy
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("cc or make not installed")
    proj = _project_copy(tmp_path)
    src = proj / "factors" / "host_scale.c"
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", src)

    def make(*args):
        return subprocess.run(["make", "-C", str(proj), "NVCC=/nonexistent/nvcc", *args],
                              capture_output=True, text=True)

    assert make("-q").returncode == 1                 # not built yet
    r = make()
    assert r.returncode == 0, r.stderr
    assert make("-q").returncode == 0, "up to date after a build"
    so = proj / "factors" / "host_scale.so"
    earlier = time.time() - 60
    os.utime(so, (earlier, earlier))                  # (older than its source)
    assert make("-q").returncode == 1                 # its source is newer
    assert make().returncode == 0 and make("-q").returncode == 0
    (proj / "factors" / "host_scale.cpp").write_text("// a second source of the same name\n")
    r = make()
    assert r.returncode != 0 and "more than one source for host_scale" in r.stderr, r.stderr
    assert make("-q").returncode != 0
