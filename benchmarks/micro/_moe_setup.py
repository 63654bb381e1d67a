"""Common start of the torch micro-benchmarks in this folder: their command line (model:T
cases), the GPU check, the model list, a registry of factors/ and a seeded generator."""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _timing import torch  # noqa: E402
from ex_engine import FactorRegistry  # noqa: E402
from ex_engine.moe_layer import load_models_or_exit, parse_cases, report_problems  # noqa: E402


def start(doc: str, tool: str):
    """([(model, T, its shape)], registry, generator) from the command line of ``tool``, whose
    docstring's first paragraph is its description; exits 2 with one line per problem (bad
    cases, no torch or no GPU)."""
    ap = argparse.ArgumentParser(prog=tool, description=doc.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("cases", nargs="+", help="model:T pairs (models of manifests/moe_models.yaml)")
    args = ap.parse_args()
    models = load_models_or_exit(tool)
    cases, problems = parse_cases(models, args.cases)
    if report_problems(tool, problems):
        sys.exit(2)
    if report_problems(tool, [] if torch is not None and torch.cuda.is_available()
                       else ["needs PyTorch and a CUDA GPU"]):
        sys.exit(2)
    return ([(m, t, models[m]) for m, t in cases], FactorRegistry.load(None),
            torch.Generator(device="cuda").manual_seed(0))


if __name__ == "__main__":   # run alone (`--help` printed nothing, exit 0): say what it is
    import argparse as _argparse
    _users = sorted(p.name for p in Path(__file__).parent.glob("*.py") if p.name != Path(__file__).name)
    _argparse.ArgumentParser(prog="_moe_setup.py", description=(
        "A library module, not a benchmark: the common start (model:T cases, the GPU check, a "
        "registry, a seeded generator) of " + ", ".join(_users) + " in this folder; run one of "
        "those (each answers --help).")).parse_args()
    print("_moe_setup.py is a library module: run one of " + ", ".join(_users), file=sys.stderr)
    sys.exit(2)
