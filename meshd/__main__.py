from __future__ import annotations

from meshd.cli import main

raise SystemExit(main())
