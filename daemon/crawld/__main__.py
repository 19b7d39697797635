import sys

from crawld.cli import main

sys.exit(main())
