from clipserve.cli import main

raise SystemExit(main())
