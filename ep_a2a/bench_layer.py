"""`python -m ep_a2a.bench_layer`: runs ep_a2a/tools/bench_layer.py (the command's home), or with
--overlap ep_a2a/tools/bench_layer_overlap.py (the two-micro-batch step); nothing else lives here."""
import sys

from .tools.bench_layer import main
from .tools.bench_layer_overlap import main as main_overlap

if __name__ == "__main__":
    sys.exit(main_overlap() if "--overlap" in sys.argv[1:] else main())
