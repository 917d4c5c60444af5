"""`python -m prefix_service ...` is the `prefix-service` command."""
import sys

from prefix_service.cli import main

sys.exit(main())
