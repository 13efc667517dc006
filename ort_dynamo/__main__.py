"""``python -m ort_dynamo``: see ``ort_dynamo.cli``."""

import sys

from .cli import main

sys.exit(main())
