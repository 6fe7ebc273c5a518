"""python -m bench.oracle: the specsweep-oracle command line."""
from .cli import main

raise SystemExit(main())
