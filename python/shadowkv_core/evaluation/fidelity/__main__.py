"""`python -m shadowkv_core.evaluation.fidelity`: see `cli.main`."""

import sys

from .cli import main

sys.exit(main())
