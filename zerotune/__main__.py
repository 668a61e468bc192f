import sys

from zerotune.cli import main

sys.exit(main())
