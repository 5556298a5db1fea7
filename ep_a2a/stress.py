"""`python -m ep_a2a.stress`: runs ep_a2a/tools/stress.py (the command's home); nothing else lives here."""
import sys

from .tools.stress import main

if __name__ == "__main__":
    sys.exit(main())
