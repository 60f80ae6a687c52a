import sys

from clipserve.bench.cli import main

sys.exit(main())
