from hladsl.cli import main

raise SystemExit(main())
