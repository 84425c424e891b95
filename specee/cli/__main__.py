"""`python -m specee.cli`: the `specee` command."""
import sys

from . import main

sys.exit(main())
