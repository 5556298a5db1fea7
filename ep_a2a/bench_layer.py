"""`python -m ep_a2a.bench_layer`: runs ep_a2a/tools/bench_layer.py (the command's home); nothing else lives here."""
import sys

from .tools.bench_layer import main

if __name__ == "__main__":
    sys.exit(main())
