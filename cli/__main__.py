"""`python -m cli ...` is the `ftc` command."""

import sys

from cli.main import main

sys.exit(main())
