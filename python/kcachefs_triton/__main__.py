"""python3 -m kcachefs_triton stats DIR...: the cache manager's counters (stats.py)."""
import sys

from .stats import main

sys.exit(main(sys.argv[1:]))
