import sys

from rl_engine.audit.cli import main

sys.exit(main())
