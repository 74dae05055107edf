"""`python -m hetpeer.cli`: the `hetpeer` command."""

import sys

from hetpeer.cli import main

sys.exit(main())
