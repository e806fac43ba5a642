"""`python -m jspec.cli`, as the `jspec` script."""

from jspec.cli.main import main

raise SystemExit(main())
