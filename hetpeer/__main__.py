import sys

from hetpeer.cli import main

sys.exit(main())
