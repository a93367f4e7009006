"""``python -m kdp``: the kdp command line (see `kdp.cli`)."""

import os
import sys

# `python -m` puts the working directory first on sys.path: a folder named `kdp`
# there (e.g. a clone of this repository) shadows the installed package as an
# empty namespace package. Import the package this file belongs to instead.
if getattr(sys.modules.get("kdp"), "__file__", None) is None:
    sys.modules.pop("kdp", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
