"""python -m ex_engine: the same as the ex-engine command."""
import sys

from .cli import main

sys.exit(main())
