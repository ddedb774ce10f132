"""`python -m tokensampler` is the `tokensampler` command."""

import sys

from .tools.cli import main

sys.exit(main())
