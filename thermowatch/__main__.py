"""`python -m thermowatch ...` is the `thermowatch` command."""

import sys

from thermowatch.cli import main

sys.exit(main(sys.argv[1:]))
