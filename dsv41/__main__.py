"""`python -m dsv41` = the `dsv41` console script."""

import sys

from .cli import main

sys.exit(main())
