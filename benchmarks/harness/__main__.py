"""``python -m benchmarks.harness``: the harness's command line (``benchmarks.harness.cli``)."""

import sys

from benchmarks.harness.cli import main

sys.exit(main())
