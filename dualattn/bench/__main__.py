import sys

if any(arg == "--cases" or arg.startswith("--cases=") for arg in sys.argv[1:]):
    from .options import main   # the options cases (issue #31's table): --cases options, or some of them
else:
    from .flash import main     # the sweep over sequence lengths

raise SystemExit(main())
