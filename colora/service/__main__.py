"""`python -m colora.service ...`: the same as `colora serve ...` (colora/service/cli.py)."""

import sys

from colora.service.cli import main

sys.exit(main())
