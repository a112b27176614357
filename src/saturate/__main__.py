import sys

from saturate.cli import main

sys.exit(main())
