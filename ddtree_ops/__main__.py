from __future__ import annotations

# The entry module first, alone: its signal handlers are in place before the second of
# imports that cli.main brings (a Ctrl-C there is one line and 130, not a traceback).
from ddtree_ops.cli.entry import main

if __name__ == "__main__":
    main()
