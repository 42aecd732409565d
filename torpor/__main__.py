"""``python -m torpor``: the same as the ``torpor`` console script."""

from torpor.cli import main

raise SystemExit(main())
