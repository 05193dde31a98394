import sys

from halfbyte.cli import main

sys.exit(main())
