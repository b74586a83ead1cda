"""`python -m shardproof`: the command line."""

import sys

from shardproof.cli import main

sys.exit(main())
