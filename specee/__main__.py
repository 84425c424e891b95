"""`python -m specee`: the `specee` command."""
import sys

from .cli import main

sys.exit(main())
