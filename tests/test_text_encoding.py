"""Every text file the project's code opens names its encoding (session forty-three's ASCII-locale
trial: files read in the locale's encoding failed on README.md's 'µs' under LC_ALL=C with UTF-8
mode off). A guard over the code that users run (ex_engine/, benchmarks/, scripts/, examples/,
docs/): open() in text mode, Path.read_text / write_text, and subprocess calls with text=True
(or universal_newlines) without encoding= fail it, each named by file and line. The tests
themselves are left out: they write ASCII literals, which every locale encodes, and
tests/test_trial43loc.py runs the tools under an ASCII locale."""
import ast

from tests.conftest import ROOT

FOLDERS = ("ex_engine", "benchmarks", "scripts", "examples", "docs")


def unencoded_text_io(source: str) -> list:
    """(line, what) of each text-mode file or subprocess call in ``source`` without encoding=."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        kws = {k.arg for k in n.keywords}
        if "encoding" in kws or None in kws:   # encoding= given, or **kwargs (not decidable here)
            continue
        if name in ("read_text", "write_text"):
            found.append((n.lineno, f"{name}()"))
        elif name == "open" and isinstance(f, ast.Name):   # builtins.open, not os.open or x.open
            mode = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                found.append((n.lineno, "open() in text mode"))
        elif name in ("run", "check_output", "Popen", "check_call") and any(
                k.arg in ("text", "universal_newlines") and not (isinstance(k.value, ast.Constant) and not k.value.value)
                for k in n.keywords):
            found.append((n.lineno, f"{name}(text=True)"))
    return found


def test_the_guard_finds_what_it_looks_for():
    src = '''
open("a")
open("a", "w")
open("a", mode="r")
open("a", "rb")
open("a", encoding="utf-8")
p.read_text()
p.write_text("x", encoding="utf-8")
subprocess.run(["x"], text=True)
subprocess.run(["x"], text=False)
subprocess.run(["x"], capture_output=True)
os.open("a", 0)
'''
    assert unencoded_text_io(src) == [(2, "open() in text mode"), (3, "open() in text mode"),
                                      (4, "open() in text mode"), (7, "read_text()"), (9, "run(text=True)")]


def test_every_text_file_the_code_opens_names_its_encoding():
    bad = []
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            for line, what in unencoded_text_io(p.read_text(encoding="utf-8")):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {what} without encoding=")
    assert not bad, "\n".join(bad)
