"""``python -m kdp``: the kdp command line (see `kdp.cli`)."""

import sys

from kdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
