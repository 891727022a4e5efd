from checkpointless.cli import main

raise SystemExit(main())
