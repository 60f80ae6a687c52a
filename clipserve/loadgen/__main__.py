import sys

from clipserve.loadgen.cli import main

sys.exit(main())
