"""`python -m ep_a2a.bench`: runs ep_a2a/tools/bench_cli.py (the command's home); nothing else lives here."""
import sys

from .tools.bench_cli import main

if __name__ == "__main__":
    sys.exit(main())
