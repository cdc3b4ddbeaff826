from quilld.cli import main

raise SystemExit(main())
