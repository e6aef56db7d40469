"""`python -m gpuscope ...`: the same as the `gpuscope` command."""

import sys

from gpuscope.cli import main

if __name__ == "__main__":
    sys.exit(main())
