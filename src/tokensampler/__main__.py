"""`python -m tokensampler` is the `tokensampler` command."""

import sys

from .cli import main

sys.exit(main())
