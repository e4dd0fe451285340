import sys

from nxdi_bench.cli import main

sys.exit(main())
