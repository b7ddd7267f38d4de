import sys

from hybrid.cli import main

if __name__ == "__main__":  # (tensor-parallel workers are spawned: they re-import this module)
    sys.exit(main())
