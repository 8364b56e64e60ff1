"""``python -m jaxsane ...``: the command line (:mod:`jaxsane.cli`)."""

import sys

from .cli import main

sys.exit(main())
