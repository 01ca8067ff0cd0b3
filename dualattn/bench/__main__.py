from .flash import main

raise SystemExit(main())
