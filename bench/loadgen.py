"""The load generator moved into the package: `clipserve-bench` or `python -m clipserve.bench`.

`python -m bench.loadgen ARGS` still works and runs the same command.
"""

import sys

from clipserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
