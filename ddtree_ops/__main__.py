from __future__ import annotations

from ddtree_ops.cli.main import run

if __name__ == "__main__":
    run()
