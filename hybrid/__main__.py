import sys

from hybrid.cli import main

sys.exit(main())
